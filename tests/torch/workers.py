"""Worker entry points for tests that need each rank's trained weights, not just rank 0's summary.

They go through the same pieces as `crosstrain run`: torch's elastic agent, gloo, TorchStrategy, train().
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from crosstrain.backends.host import free_port
from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.backends.torch.worker import join_group
from crosstrain.core.run.evaluation import evaluate
from crosstrain.core.run.job import Job
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.loop import initial_weights, train
from crosstrain.plugins.manager import make_plugin_manager

T = TypeVar("T")


def _weights_entry(job: Job) -> dict[str, np.ndarray]:
    import torch.distributed as dist

    world, device = join_group(job)
    strategy = TorchStrategy(world=world, device=device)
    _, state = train(strategy, job, make_plugin_manager(job.launch.plugins).hook)
    weights = strategy.state_dict(state)
    if dist.is_initialized():
        dist.destroy_process_group()
    return weights


def _eval_entry(job: Job) -> dict[str, float]:
    """Evaluate the initial weights: the same weights at every world size, so any difference
    between world sizes comes from evaluation alone."""
    import torch.distributed as dist

    world, device = join_group(job)
    strategy = TorchStrategy(world=world, device=device)
    state = strategy.build(job.plan, initial_weights(job.plan))
    evaluation = load_datasets(job.plan).eval
    assert evaluation is not None
    metrics = evaluate(strategy, state, evaluation, job.plan)
    if dist.is_initialized():
        dist.destroy_process_group()
    return metrics


def weights_per_rank(job: Job) -> dict[int, dict[str, np.ndarray]]:
    return dict(_launch(job, _weights_entry))


def eval_per_rank(job: Job) -> dict[int, dict[str, float]]:
    return dict(_launch(job, _eval_entry))


def _launch(job: Job, entry: Callable[[Job], T]) -> dict[int, T]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=job.replicas,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    return dict(elastic_launch(config, entry)(job))
