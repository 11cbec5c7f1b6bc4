"""Start one process per replica with torch's elastic agent, or join a torchrun group.

The elastic agent watches every worker: when one dies or raises, it stops the
others and reports the failure, so a broken rank ends the job instead of hanging it.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from crosstrain.backends.common import free_port
from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.core.errors import BackendError, WorkerError
from crosstrain.core.plan import check_world_fits
from crosstrain.core.strategy import Job, RunResult, World
from crosstrain.core.worker import attempt_job, run_worker

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def resolve_device(choice: str) -> str:
    """'auto' is the GPU when there is one; 'gpu' without one is an error, not a silent CPU run."""
    has_gpu = torch.cuda.is_available()
    if choice == "gpu" and not has_gpu:
        raise BackendError("--device gpu, but torch sees no CUDA GPU")
    return "cuda" if choice == "gpu" or (choice == "auto" and has_gpu) else "cpu"


def check_layout(job: Job) -> None:
    """One process per replica, and one GPU per process when training on GPUs."""
    if launched_by_torchrun():
        check_world_fits(job.plan, int(os.environ["WORLD_SIZE"]))
        return  # torchrun already chose the processes; each process has its own device
    processes = job.workers or job.replicas
    if processes != job.replicas:
        raise BackendError(
            f"the torch backend runs one process per replica: --workers ({processes}) "
            f"must equal --nproc ({job.replicas})"
        )
    if resolve_device(job.device) == "cuda" and torch.cuda.device_count() < processes:
        gpus = torch.cuda.device_count()
        raise BackendError(f"--nproc {processes} needs {processes} GPUs; torch sees {gpus}")


def launch(job: Job) -> RunResult:
    check_layout(job)
    if launched_by_torchrun():
        # torchrun already chose the world; --nproc cannot be passed through its own parser
        world_size = int(os.environ["WORLD_SIZE"])
        return RunResult(_worker(attrs.evolve(job, replicas=world_size)) or {}, job.out_dir)
    processes = job.replicas
    if job.max_restarts > 0:
        # A restarted group on the agent's shared store can read the dead workers' gloo
        # addresses (measured: "Connection refused" in connectFullMesh, 1 restart in 2);
        # without sharing, each round's rank 0 hosts a fresh store. Read by the agent here.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=f"crosstrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": int(job.timeout_seconds)},
        max_restarts=job.max_restarts,  # each restart resumes (see _worker)
        monitor_interval=0.1,
        start_method="spawn",
    )
    _quiet_elastic_logs()
    try:
        results = elastic_launch(config, _worker)(job)
    except ChildFailedError as failure:
        raise _worker_error(failure) from None
    return RunResult(results[0], job.out_dir)


def _quiet_elastic_logs() -> None:
    """The agent logs a failed worker's traceback itself; it reaches the user once, as WorkerError."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _worker_error(failure: ChildFailedError) -> WorkerError:
    rank, first = failure.get_first_failure()
    message = first.message if isinstance(first.message, str) else str(first.message.get("message", ""))
    traceback_text = ""
    if isinstance(first.error_file_data, dict):
        extra = first.error_file_data.get("message", {})
        if isinstance(extra, dict):
            traceback_text = str(extra.get("extraInfo", {}).get("py_callstack", ""))
    if not message:
        message = f"exit code {first.exitcode}"
    return WorkerError(rank, message.splitlines()[0] if message else "", traceback_text)


# --------------------------------------------------------------------------- in the worker


@record
def _worker(job: Job) -> dict[str, Any]:
    """Entry point of each worker process: join the group, train, leave the group."""
    world, device = _join_group(job)
    job = attempt_job(job, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    try:
        return run_worker(TorchStrategy(world=world, device=device), job)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_group(job: Job) -> tuple[World, str]:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(job.device)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        # One thread per worker: N workers on N cores each spawning N threads run ~7x slower.
        torch.set_num_threads(1)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.startswith("cuda") else "gloo",
            timeout=datetime.timedelta(seconds=job.timeout_seconds),
            device_id=torch.device(device) if device.startswith("cuda") else None,
        )
    return World(process_index=rank, process_count=world_size, local_replicas=1, device=device), device
