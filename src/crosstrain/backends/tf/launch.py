"""Start TensorFlow worker processes, watch them, and report the first failure.

TensorFlow fixes its devices at its first op, and two replicas on one CPU need two
logical CPU devices configured before that. So training always runs in fresh worker
processes: one holding every replica (MirroredStrategy), one per worker with a
TF_CONFIG written here (MultiWorkerMirroredStrategy on 127.0.0.1), or, when TF_CONFIG
is already set, one that joins that cluster as its task.

The launcher polls its workers. Each worker writes its traceback to a per-rank error
file and exits; on the first failure the launcher stops the others and raises
WorkerError with that traceback, so a broken rank ends the job instead of hanging it.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from crosstrain.backends.common import free_port
from crosstrain.backends.tf.strategy import TF_ENVIRONMENT, TfStrategy
from crosstrain.core.errors import BackendError, CrosstrainError, WorkerError
from crosstrain.core.strategy import Job, RunResult, World

TF_CONFIG = "TF_CONFIG"
POLL_SECONDS = 0.1
STOP_SECONDS = 5.0  # after SIGTERM, how long a worker may take before SIGKILL
EXIT_GRACE_SECONDS = 30.0  # a worker that reported its result but does not exit is stopped
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


@attrs.frozen
class WorkerProcess:
    rank: int
    process: subprocess.Popen[bytes]


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
    with tempfile.TemporaryDirectory(prefix="crosstrain-tf-") as run_dir:
        with open(Path(run_dir) / JOB_FILE, "wb") as handle:
            pickle.dump((job, layout), handle)
        if cluster is not None:
            ranks, environments = [cluster.rank], [_environment(run_dir, dict(os.environ))]
        else:
            ranks = list(range(layout.workers))
            ports = [free_port() for _ in ranks]
            environments = [_environment(run_dir, _local_config(layout, ports, rank)) for rank in ranks]
        workers: list[WorkerProcess] = []
        try:
            for local_index, (rank, environment) in enumerate(zip(ranks, environments, strict=True)):
                workers.append(_start_worker(run_dir, rank, local_index, len(ranks), environment))
            supervise(workers, Path(run_dir))
        finally:
            stop(workers)
        return RunResult(_read_result(Path(run_dir), ranks[0]), job.out_dir)


def _local_config(layout: Layout, ports: Sequence[int], rank: int) -> dict[str, str]:
    environment = {name: value for name, value in os.environ.items() if name != TF_CONFIG}
    if layout.workers > 1:
        environment[TF_CONFIG] = local_cluster_config(ports, rank)
    return environment


def _environment(run_dir: str, environment: dict[str, str]) -> dict[str, str]:
    for name, value in TF_ENVIRONMENT.items():
        environment.setdefault(name, value)
    environment.setdefault("KERAS_HOME", str(Path(run_dir) / "keras"))
    environment["KERAS_BACKEND"] = "tensorflow"  # a user's keras.json may name another backend
    environment["PYTHONUNBUFFERED"] = "1"
    return environment


def _start_worker(
    run_dir: str, rank: int, local_index: int, local_workers: int, environment: dict[str, str]
) -> WorkerProcess:
    """``local_index`` picks this worker's GPUs; ``local_workers`` share this host's cores."""
    command = [
        sys.executable,
        "-c",
        "from crosstrain.backends.tf.launch import worker_main; worker_main()",
        run_dir,
        str(rank),
        str(local_index),
        str(local_workers),
    ]
    return WorkerProcess(rank, subprocess.Popen(command, env=environment))


def supervise(workers: Sequence[WorkerProcess], run_dir: Path) -> None:
    """Wait until every worker has exited cleanly; raise WorkerError on the first failure."""
    all_reported_at: float | None = None
    while True:
        codes = {worker.rank: worker.process.poll() for worker in workers}
        failed = [
            rank
            for rank, code in codes.items()
            if code is not None and (code != 0 or not _result_path(run_dir, rank).exists())
        ]
        if failed:
            raise first_failure(failed, codes, run_dir)
        if all(code == 0 for code in codes.values()):
            return
        if all(_result_path(run_dir, worker.rank).exists() for worker in workers):
            # every rank finished training; one stuck in TensorFlow's shutdown is stopped
            all_reported_at = all_reported_at or time.monotonic()
            if time.monotonic() - all_reported_at > EXIT_GRACE_SECONDS:
                return
        time.sleep(POLL_SECONDS)


def first_failure(failed: Sequence[int], codes: Mapping[int, int | None], run_dir: Path) -> WorkerError:
    """The failure that caused the others. A rank that dies without a report (a signal, a
    crash in native code) comes first: its peers only report the collectives it broke.
    Otherwise the earliest report wins, for the same reason."""
    abrupt = [rank for rank in failed if not _error_path(run_dir, rank).exists()]
    if abrupt:
        return WorkerError(abrupt[0], _describe_exit(codes[abrupt[0]]))
    reports = {rank: report for rank in codes if (report := _read_error(run_dir, rank)) is not None}
    rank = min(reports, key=lambda r: float(reports[r]["time"]))
    return WorkerError(rank, str(reports[rank]["message"]), str(reports[rank]["traceback"]))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    if code == 0:
        return "exited without reporting a result"
    return f"exited with code {code}"


def stop(workers: Sequence[WorkerProcess]) -> None:
    """SIGTERM every worker still running, then SIGKILL those that outlive STOP_SECONDS."""
    running = [worker.process for worker in workers if worker.process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_SECONDS)


def _result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"result-{rank}.json"


def _error_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-{rank}.json"


def _read_result(run_dir: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads(_result_path(run_dir, rank).read_text(encoding="utf-8")))


def _read_error(run_dir: Path, rank: int) -> dict[str, Any] | None:
    path = _error_path(run_dir, rank)
    if not path.exists():
        return None
    return dict(json.loads(path.read_text(encoding="utf-8")))


def _write_atomically(path: Path, data: Any) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data), encoding="utf-8")
    os.replace(temporary, path)


# --------------------------------------------------------------------------- in the worker


def worker_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of each worker process: ``RUN_DIR RANK LOCAL_INDEX LOCAL_WORKERS``."""
    run_dir, rank_text, local_text, local_workers = list(sys.argv[1:] if argv is None else argv)
    run_path, rank = Path(run_dir), int(rank_text)
    try:
        with open(run_path / JOB_FILE, "rb") as handle:
            job, layout = pickle.load(handle)
        summary = _train(job, layout, rank, int(local_text), int(local_workers))
        _write_atomically(_result_path(run_path, rank), summary)
    except BaseException as error:  # every failure, even SystemExit, reaches the launcher once
        message = error_summary(error)
        _write_atomically(
            _error_path(run_path, rank),
            {"message": message, "traceback": traceback.format_exc(), "time": time.time()},
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip TensorFlow's teardown, which can wait on peers that are gone


def error_summary(error: BaseException) -> str:
    """One line for the error message; the traceback carries the rest. TensorFlow's
    errors open with "in user code:" and end with the real cause, so take the last line then."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = (lines[-1] if lines[0].endswith(":") else lines[0]) if lines else ""
    kind = type(error).__name__
    if isinstance(error, CrosstrainError) or line.startswith(f"{kind}:"):
        return line
    return f"{kind}: {line}" if line else kind


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
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=job.timeout_seconds)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
