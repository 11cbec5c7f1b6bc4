"""Start TensorFlow worker processes, watch them, and report the first failure.

TensorFlow fixes its devices at its first op, and two replicas on one CPU need two
logical CPU devices configured before that. So training always runs in fresh worker
processes: one holding every replica (MirroredStrategy), one per worker with a
TF_CONFIG written here (MultiWorkerMirroredStrategy on 127.0.0.1), or, when TF_CONFIG
is already set, one that joins that cluster as its task.

The workers run under crosstrain's shared launcher (:mod:`crosstrain.launch`): error
files, heartbeat, stopping the others on the first failure, dying with the launcher, and
``--max-restarts`` (the whole group started again on fresh ports, resuming).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from crosstrain.backends.common import free_port
from crosstrain.backends.tf.strategy import TF_ENVIRONMENT, TfStrategy
from crosstrain.core.errors import BackendError
from crosstrain.core.heartbeat import collective_timeout
from crosstrain.core.strategy import Job, RunResult, World
from crosstrain.launch import WorkerSpec, launch_folder, run_workers, serve
from crosstrain.launch.worker import restart_count, worker_folder, worker_rank

TF_CONFIG = "TF_CONFIG"
JOB_FILE = "job.pkl"


@attrs.frozen
class Layout:
    """How the job's replicas map onto processes and devices."""

    workers: int
    local_replicas: int
    device: str  # "cpu" or "gpu"


@attrs.frozen
class Cluster:
    """A TF_CONFIG this process was started with: the cluster to join and our place in it."""

    workers: int
    rank: int


# --------------------------------------------------------------------------- layout


def cluster_from_environment(environ: Mapping[str, str] = os.environ) -> Cluster | None:
    """The user's TF_CONFIG as a Cluster; chief (if any) is rank 0, then the workers."""
    text = environ.get(TF_CONFIG)
    if not text:
        return None
    try:
        config = json.loads(text)
        spec, task = config["cluster"], config["task"]
        task_type, task_index = str(task["type"]), int(task["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise BackendError(f"TF_CONFIG is not a valid cluster description: {error}") from None
    if task_type not in ("chief", "worker"):
        raise BackendError(f"TF_CONFIG task type {task_type!r}: crosstrain joins as chief or worker")
    chiefs, workers = len(spec.get("chief", [])), len(spec.get("worker", []))
    rank = task_index if task_type == "chief" else chiefs + task_index
    return Cluster(workers=chiefs + workers, rank=rank)


def physical_gpus() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def plan_layout(job: Job, cluster: Cluster | None, gpus: int) -> Layout:
    """Workers, replicas per worker and device kind; refuses layouts that cannot run."""
    workers = cluster.workers if cluster else (job.workers or 1)
    if job.workers is not None and job.workers != workers:
        raise BackendError(f"--workers {job.workers}, but TF_CONFIG describes {workers} workers")
    if job.replicas % workers:
        raise BackendError(f"--nproc {job.replicas} replicas do not split evenly over {workers} workers")
    local = job.replicas // workers
    needed = local if cluster else job.replicas  # a joined worker only sees its own host
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


def local_cluster_config(ports: Sequence[int], rank: int) -> str:
    hosts = [f"127.0.0.1:{port}" for port in ports]
    return json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": rank}})


# --------------------------------------------------------------------------- launcher


def launch(job: Job) -> RunResult:
    cluster = cluster_from_environment()
    layout = plan_layout(job, cluster, physical_gpus() if job.device != "cpu" else 0)
    with launch_folder("tf") as run_dir:
        with open(run_dir / JOB_FILE, "wb") as handle:
            pickle.dump((job, layout), handle)
        specs = functools.partial(_group_specs, run_dir, layout, cluster)
        results = run_workers(specs, run_dir, job.timeout_seconds, job.max_restarts, Path(job.out_dir))
        ranks = [cluster.rank] if cluster is not None else list(range(layout.workers))
        return RunResult(results[ranks[0]], job.out_dir)


def _group_specs(run_dir: Path, layout: Layout, cluster: Cluster | None, restart: int) -> list[WorkerSpec]:
    """The workers of one (re)start of the group (``restart``: which): a cluster of our own
    gets fresh ports each time, since the last group's may not be free yet."""
    if cluster is not None:
        ranks, environments = [cluster.rank], [_environment(run_dir, dict(os.environ))]
    else:
        ranks = list(range(layout.workers))
        ports = [free_port() for _ in ranks]
        environments = [_environment(run_dir, _local_config(layout, ports, rank)) for rank in ranks]
    return [
        WorkerSpec(rank, _worker_command(local_index, len(ranks)), environment)
        for local_index, (rank, environment) in enumerate(zip(ranks, environments, strict=True))
    ]


def _local_config(layout: Layout, ports: Sequence[int], rank: int) -> dict[str, str]:
    environment = {name: value for name, value in os.environ.items() if name != TF_CONFIG}
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


def _worker_command(local_index: int, local_workers: int) -> list[str]:
    """``local_index`` picks this worker's GPUs; ``local_workers`` share this host's cores."""
    return [
        sys.executable,
        "-c",
        "from crosstrain.backends.tf.launch import worker_main; worker_main()",
        str(local_index),
        str(local_workers),
    ]


# --------------------------------------------------------------------------- in the worker


def worker_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of each worker process: ``LOCAL_INDEX LOCAL_WORKERS``; the launch folder
    and rank come from the environment (:mod:`crosstrain.launch.worker`)."""
    local_text, local_workers = list(sys.argv[1:] if argv is None else argv)

    def train() -> dict[str, Any]:
        from crosstrain.core.worker import attempt_job

        with open(worker_folder() / JOB_FILE, "rb") as handle:
            job, layout = pickle.load(handle)
        job = attempt_job(job, restart_count())  # a restarted group resumes
        return _train(job, layout, worker_rank(), int(local_text), int(local_workers))

    serve(train)


def _train(job: Job, layout: Layout, rank: int, local_index: int, local_workers: int) -> dict[str, Any]:
    from crosstrain.core.worker import run_worker

    devices = configure_devices(layout, local_index, local_workers)
    distribution = make_distribution(job, layout, devices)
    world = World(
        process_index=rank,
        process_count=layout.workers,
        local_replicas=layout.local_replicas,
        device=layout.device,
    )
    if distribution.num_replicas_in_sync != world.replicas:
        raise BackendError(
            f"TensorFlow made {distribution.num_replicas_in_sync} replicas, the job asks for {world.replicas}"
        )
    return run_worker(TfStrategy(world=world, distribution=distribution), job)


def configure_devices(layout: Layout, local_index: int, local_workers: int) -> list[str]:
    """Make this process's replica devices visible; must run before any TensorFlow op."""
    import tensorflow as tf

    count = layout.local_replicas
    if layout.device == "gpu":
        mine = tf.config.list_physical_devices("GPU")[local_index * count : (local_index + 1) * count]
        tf.config.set_visible_devices(mine, "GPU")
        for gpu in mine:
            tf.config.experimental.set_memory_growth(gpu, True)
        return [f"/gpu:{index}" for index in range(count)]
    tf.config.set_visible_devices([], "GPU")
    if count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    # processes sharing the machine's cores: one pool each, sized to its share
    threads = max(1, (os.cpu_count() or 1) // local_workers)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    return [f"/cpu:{index}" for index in range(count)]


def make_distribution(job: Job, layout: Layout, devices: list[str]) -> Any:
    import tensorflow as tf

    if layout.workers == 1:
        return tf.distribute.MirroredStrategy(devices=devices)
    # longer than the launcher's heartbeat deadline: a hang is reported naming the rank behind
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=collective_timeout(job.timeout_seconds)
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
