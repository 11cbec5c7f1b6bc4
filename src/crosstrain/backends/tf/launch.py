"""Start TensorFlow worker processes, watch them, and report the first failure.

TensorFlow fixes its devices at its first op, and two replicas on one CPU need two
logical CPU devices configured before that. So training always runs in fresh worker
processes: one holding every replica (MirroredStrategy), one per worker with a
TF_CONFIG written here (MultiWorkerMirroredStrategy on 127.0.0.1), or, when TF_CONFIG
is already set, one that joins that cluster as its task.

Across machines (``--nnodes``) and under an outside launcher that starts one process per
worker (torchrun, srun, Kubeflow: :mod:`crosstrain.launch.environments`), the TF_CONFIG
is built from the same facts: node 0 (rank 0) serves a small address exchange
(:mod:`crosstrain.launch.store`), every machine puts its workers' ``host:port`` there
and reads everyone's, so one cluster forms instead of N separate jobs.

The workers run under crosstrain's shared launcher (:mod:`crosstrain.launch`): error
files, heartbeat, stopping the others on the first failure, dying with the launcher, and
``--max-restarts`` (the whole group started again on fresh ports, resuming).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from crosstrain.backends.host import free_port
from crosstrain.backends.tf.runtime import TF_ENVIRONMENT
from crosstrain.core.errors import BackendError
from crosstrain.core.run.job import Job, RunResult, World
from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.launch import WorkerSpec, launch_folder, run_workers
from crosstrain.launch.environments import (
    TF_CONFIG,
    ClusterEnvironment,
    TfConfigEnvironment,
    detect_environment,
    parse_endpoint,
)
from crosstrain.launch.gpus import count_gpus
from crosstrain.launch.store import exchange, reachable_address, serve_store

JOB_FILE = "job.pkl"
#: what builds a worker's strategy from its world and tf.distribute strategy: TfStrategy itself
StrategyMaker = Callable[[World, Any], DistributedStrategy]


@attrs.frozen
class Layout:
    """How the job's replicas map onto processes and devices."""

    workers: int
    local_replicas: int
    device: str  # "cpu" or "gpu"


@attrs.frozen
class Cluster:
    """An outside launcher's group this process belongs to (torchrun, srun, Kubeflow, a
    TF_CONFIG): its processes are the workers, and this one is ``rank``."""

    workers: int
    rank: int
    #: how errors name it, e.g. "TF_CONFIG describes 3 workers"
    described: str = attrs.field(default="", eq=False)


# --------------------------------------------------------------------------- layout


def cluster_from_environment(environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The outside launcher's group, or None when crosstrain starts the workers."""
    environment = detect_environment(environ)
    if environment.starts_processes:
        return None
    return Cluster(environment.world_size(), environment.rank(), environment.describe())


def physical_gpus() -> int:
    """The GPUs TensorFlow sees. Where the driver lists none, TensorFlow sees none either,
    and is not asked: importing it costs seconds of CPU in a launcher that runs no step."""
    if count_gpus() == 0:
        return 0
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def plan_layout(job: Job, cluster: Cluster | None, gpus: int) -> Layout:
    """Workers, replicas per worker and device kind; refuses layouts that cannot run."""
    # on several machines, one worker per replica by default (as torch), at least one each
    workers = cluster.workers if cluster else (job.workers or (job.replicas if job.nnodes > 1 else 1))
    if cluster is not None and job.workers is not None and job.workers != workers:
        raise BackendError(f"--workers {job.workers}, but {cluster.described}")
    if workers % job.nnodes:
        raise BackendError(f"--workers {workers} is not a multiple of --nnodes {job.nnodes}")
    if job.replicas % workers:
        raise BackendError(f"--nproc {job.replicas} replicas do not split evenly over {workers} workers")
    local = job.replicas // workers
    # a joined worker only sees its own host, a machine its own workers'
    needed = local if cluster else job.replicas // job.nnodes
    device = "gpu" if job.device == "gpu" or (job.device == "auto" and gpus > 0) else "cpu"
    if job.device == "gpu" and gpus == 0:
        raise BackendError("--device gpu, but TensorFlow sees no GPU")
    if device == "gpu" and gpus < needed:
        raise BackendError(
            f"--nproc {job.replicas} needs {needed} GPUs here; TensorFlow sees {gpus} "
            f"(--device cpu runs the replicas on the CPU)"
        )
    if device == "cpu" and workers > 1 and local > 1:
        raise BackendError(
            f"on CPU, MultiWorkerMirroredStrategy runs one replica per worker: --nproc "
            f"({job.replicas}) must equal --workers ({workers}), or use one worker with "
            f"{job.replicas} replicas"
        )
    return Layout(workers=workers, local_replicas=local, device=device)


def cluster_config(hosts: Sequence[str], rank: int) -> str:
    """TF_CONFIG for worker ``rank`` of the workers at ``hosts`` (``host:port``, by rank)."""
    return json.dumps({"cluster": {"worker": list(hosts)}, "task": {"type": "worker", "index": rank}})


def local_cluster_config(ports: Sequence[int], rank: int) -> str:
    return cluster_config([f"127.0.0.1:{port}" for port in ports], rank)


# --------------------------------------------------------------------------- launcher


def launch(job: Job, make_strategy: StrategyMaker) -> RunResult:
    """Run ``job`` in fresh worker processes, each running
    :func:`crosstrain.backends.tf.worker.worker_main` with the strategy ``make_strategy``
    builds there (the strategy's own class, handed down by it and pickled by reference
    into the job file: this module imports neither the strategy nor the worker)."""
    environment = detect_environment()
    cluster = cluster_from_environment()
    layout = plan_layout(job, cluster, physical_gpus() if job.device != "cpu" else 0)
    with launch_folder("tf") as run_dir, _exchange_served(job, environment):
        with open(run_dir / JOB_FILE, "wb") as handle:
            pickle.dump((job, layout, make_strategy), handle)
        first = _workers_here(job, layout, environment)
        specs = functools.partial(_group_specs, job, run_dir, layout, environment, first)
        results = run_workers(
            specs, run_dir, job.launch.timeout_seconds, job.launch.max_restarts, Path(job.out_dir)
        )
        return RunResult(results[first[0][0]], job.out_dir)


def _group_specs(
    job: Job,
    run_dir: Path,
    layout: Layout,
    environment: ClusterEnvironment,
    first: tuple[list[int], list[dict[str, str]]],
    restart: int,
) -> list[WorkerSpec]:
    """The workers of one (re)start of the group (``restart``: which). A group this launcher
    owns whole (one machine, its own cluster) gets fresh ports each time, since the last
    group's may not be free yet; a cluster agreed with other machines or given by the user
    keeps its addresses."""
    ranks, variables = first
    if restart > 0 and _owns_whole_cluster(job, environment):
        ranks, variables = _workers_here(job, layout, environment)
    return [
        WorkerSpec(rank, _worker_command(local_index), _environment(run_dir, values))
        for local_index, (rank, values) in enumerate(zip(ranks, variables, strict=True))
    ]


def _owns_whole_cluster(job: Job, environment: ClusterEnvironment) -> bool:
    return (
        environment.starts_processes and job.nnodes == 1 and not isinstance(environment, TfConfigEnvironment)
    )


def _workers_here(
    job: Job, layout: Layout, environment: ClusterEnvironment
) -> tuple[list[int], list[dict[str, str]]]:
    """The ranks of the workers this launcher starts, and each one's environment."""
    if isinstance(environment, TfConfigEnvironment):  # the user's TF_CONFIG, as it is
        return [environment.rank()], [dict(os.environ)]
    if not environment.starts_processes:  # torchrun, srun, Kubeflow: this process is one worker
        rank = environment.rank()
        if layout.workers == 1:
            return [rank], [_without_tf_config()]
        host, port = environment.main_address(), environment.exchange_port()
        hosts = _agree_on_hosts(host, port, f"rank-{rank}", 1, layout.workers, job.launch.timeout_seconds)
        return [rank], [{**_without_tf_config(), TF_CONFIG: cluster_config(hosts, rank)}]
    if job.nnodes > 1:  # this machine's share of the workers, after agreeing on everyone's
        local = layout.workers // job.nnodes
        host, port = parse_endpoint(job.launch.rdzv_endpoint)
        hosts = _agree_on_hosts(
            host, port, f"node-{job.launch.node_rank}", local, job.nnodes, job.launch.timeout_seconds
        )
        ranks = [job.launch.node_rank * local + index for index in range(local)]
        return ranks, [{**_without_tf_config(), TF_CONFIG: cluster_config(hosts, rank)} for rank in ranks]
    ranks = list(range(layout.workers))
    ports = [free_port() for _ in ranks]
    return ranks, [_local_config(layout, ports, rank) for rank in ranks]


@contextlib.contextmanager
def _exchange_served(job: Job, environment: ClusterEnvironment) -> Iterator[None]:
    """Rank 0 (node 0) serves the address exchange for the whole launch."""
    if job.nnodes > 1 and job.launch.node_rank == 0:
        with serve_store(*parse_endpoint(job.launch.rdzv_endpoint)):
            yield
    elif _exchanges(environment) and environment.rank() == 0:
        with serve_store(environment.main_address(), environment.exchange_port()):
            yield
    else:
        yield


def _exchanges(environment: ClusterEnvironment) -> bool:
    outside = not environment.starts_processes and not isinstance(environment, TfConfigEnvironment)
    return outside and environment.world_size() > 1


def _agree_on_hosts(
    host: str, port: int, key: str, local: int, participants: int, timeout_seconds: float
) -> list[str]:
    """Every worker's ``host:port``, by rank: this participant's ``local`` free ports put
    under ``key`` (``node-R`` or ``rank-R``), the others' read from the store."""
    own = reachable_address(host, port, timeout_seconds)
    mine = [f"{own}:{free_port(own)}" for _ in range(local)]
    prefix = key.rsplit("-", 1)[0]
    keys = [f"{prefix}-{index}" for index in range(participants)]
    found = exchange(host, port, key, mine, keys, timeout_seconds)
    return [address for wanted in keys for address in found[wanted]]


def _without_tf_config() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != TF_CONFIG}


def _local_config(layout: Layout, ports: Sequence[int], rank: int) -> dict[str, str]:
    environment = _without_tf_config()
    if layout.workers > 1:
        environment[TF_CONFIG] = local_cluster_config(ports, rank)
    return environment


def _environment(run_dir: Path, environment: dict[str, str]) -> dict[str, str]:
    for name, value in TF_ENVIRONMENT.items():
        environment.setdefault(name, value)
    environment.setdefault("KERAS_HOME", str(run_dir / "keras"))
    environment["KERAS_BACKEND"] = "tensorflow"  # a user's keras.json may name another backend
    environment["PYTHONUNBUFFERED"] = "1"
    return environment


def _worker_command(local_index: int) -> list[str]:
    """``local_index`` picks this worker's GPUs."""
    return [
        sys.executable,
        "-c",
        "from crosstrain.backends.tf.worker import worker_main; worker_main()",
        str(local_index),
    ]
