"""Start one process per replica with torch's elastic agent, or join a torchrun group.

The elastic agent watches every worker: when one dies or raises, it stops the
others and reports the failure, so a broken rank ends the job instead of hanging it.
Around it, crosstrain's launcher parts (:mod:`crosstrain.launch`) add what the agent
lacks: a heartbeat monitor that names the rank that stopped making progress (instead of
the healthy peer whose collective timed out), workers that die with the launcher, and
SIGINT/SIGTERM ending as :class:`Interrupted` rather than a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from crosstrain.backends.host import free_port
from crosstrain.backends.torch.worker import LAUNCHER_PID, StrategyMaker, resolve_device, worker_main
from crosstrain.core.errors import (
    BAD_INPUT_EXIT_CODE,
    BackendError,
    CrosstrainError,
    InputError,
    Interrupted,
    WorkerError,
    WorkerStalled,
)
from crosstrain.core.run.heartbeat import HEARTBEAT_DIR
from crosstrain.core.run.job import Job, RunResult
from crosstrain.core.spec.plan import check_world_fits
from crosstrain.launch import StallMonitor, launch_folder
from crosstrain.launch.environments import (
    detect_environment,
    mismatch,
    parse_endpoint,
)
from crosstrain.launch.outcomes import blame_order, describe_exit, log_failure

_MONITOR_SECONDS = 0.2
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: what every worker imports beyond what launching imported: a forked worker finds them loaded
#: (torch._dynamo comes with the first optimizer and DDP, over a second of CPU per process)
_WORKER_MODULES = (
    "torch._dynamo",
    "torch.nn.parallel",
    "crosstrain.backends.torch.feed",
    "crosstrain.backends.torch.model",
    "crosstrain.backends.torch.optimizer",
    "crosstrain.backends.torch.steps",
)


def check_layout(job: Job) -> None:
    """One process per replica, and one GPU per process when training on GPUs."""
    environment = detect_environment()
    if not environment.starts_processes:
        if job.replicas != environment.world_size():
            raise BackendError(mismatch(environment, job.replicas) + "; torch runs one process per replica")
        check_world_fits(job.plan, job.replicas)
        return  # the outside launcher chose the processes; each process has its own device
    processes = job.workers or job.replicas
    if processes != job.replicas:
        raise BackendError(
            f"the torch backend runs one process per replica: --workers ({processes}) "
            f"must equal --nproc ({job.replicas})"
        )
    local = processes // job.nnodes
    if resolve_device(job.device) == "cuda" and torch.cuda.device_count() < local:
        gpus = torch.cuda.device_count()
        raise BackendError(f"--nproc {processes} needs {local} GPUs on each machine; torch sees {gpus}")


def launch(job: Job, make_strategy: StrategyMaker) -> RunResult:
    """Run ``job`` in one process per replica, each running :func:`worker_main` with the
    strategy ``make_strategy`` builds there (the strategy's own class, handed down by it:
    this module does not import the strategy's)."""
    check_layout(job)
    if not detect_environment().starts_processes:
        # torchrun, srun or Kubeflow started this process: it is one worker of the group
        return RunResult(worker_main(job, make_strategy) or {}, job.out_dir)
    local = job.replicas // job.nnodes
    if job.launch.max_restarts > 0:
        # A restarted group on the agent's shared store can read the dead workers' gloo
        # addresses and fail to connect (docs/checkpoints.md#restarts);
        # without sharing, each round's rank 0 hosts a fresh store. Read by the agent here.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _quiet_elastic_logs()
    ranks = range(local) if job.nnodes == 1 else None  # on many machines: known after the rendezvous
    with (
        launch_folder("torch") as folder,
        _watched(folder, local, ranks, job.launch.timeout_seconds) as stalls,
        _temporary_files_in(folder),
    ):
        try:
            results = elastic_launch(_config(job, folder), worker_main)(job, make_strategy)
        except ChildFailedError as failure:
            if stalls:
                raise stalls[-1] from None
            error = _worker_error(failure)
            log_failure(error, Path(job.out_dir))
            raise error from None
        except SignalException as signalled:
            raise Interrupted(int(signalled.sigval)) from None
        except RendezvousError as error:  # a machine that never came, an endpoint nobody serves
            cause = f" ({error.__cause__})" if error.__cause__ else ""
            raise InputError(
                f"--rdzv-endpoint {job.launch.rdzv_endpoint}: the machines did not meet: {error}{cause}"
            ) from None
    return RunResult(results[min(results)], job.out_dir)  # this machine's first rank


def _config(job: Job, folder: Path) -> LaunchConfig:
    """torchrun's c10d rendezvous, as ``torchrun --nnodes N --node-rank R --rdzv-endpoint``
    configures it: every machine's agent joins at the endpoint; node 0 hosts the store."""
    seconds = max(1, math.ceil(job.launch.timeout_seconds))
    rdzv_configs: dict[str, Any] = {"timeout": seconds}
    if job.nnodes > 1:
        # the c10d handler's names: the wait for every machine, and for the store at the endpoint
        rdzv_configs.update(join_timeout=seconds, read_timeout=seconds)
        host, port = parse_endpoint(job.launch.rdzv_endpoint)
        endpoint, run_id = f"{host}:{port}", f"crosstrain-{port}"  # the same on every machine
        # torchrun guesses the store's host from the machine's names; two "machines" on one
        # host (or a multi-homed one) make that guess ambiguous, the node rank does not
        rdzv_configs["is_host"] = job.launch.node_rank == 0
    else:
        endpoint, run_id = f"127.0.0.1:{free_port()}", f"crosstrain-{uuid.uuid4().hex[:8]}"
        host = "127.0.0.1"
    return LaunchConfig(
        min_nodes=job.nnodes,
        max_nodes=job.nnodes,
        nproc_per_node=job.replicas // job.nnodes,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        # the address the other machines reach this one's workers at: torchrun's
        # --local-addr; on loopback every "machine" is this host
        local_addr="127.0.0.1" if host in _LOOPBACK else None,
        max_restarts=job.launch.max_restarts,  # each restart resumes (see worker.worker_main)
        monitor_interval=0.1,
        start_method=_start_method(job),
        # the agent's logs and error files in the launch folder, removed with it (by default
        # every run leaves a torchelastic_* folder in /tmp)
        logs_specs=DefaultLogsSpecs(log_dir=str(folder / "elastic")),
    )


def _start_method(job: Job) -> str:
    """Workers are forked from this process, once it has imported what they need, where
    torch sees no CUDA GPU: a spawned worker spends about four CPU-seconds importing torch
    again before its first step. Elsewhere they are spawned: a process forked after CUDA was
    initialised (asking whether there is a GPU does that) cannot use CUDA, and a CPU run on a
    GPU machine still touches it (pinned memory); nor is fork sound outside Linux. So are
    workers that decode images: a forked worker ends without its exit handlers, and a survivor
    the agent stops after a peer failed could leave its decoding buffers to multiprocessing's
    resource tracker, which warns of them on the launcher's stderr."""
    if (
        not sys.platform.startswith("linux")
        or resolve_device(job.device) != "cpu"
        or torch.cuda.is_available()
        or job.plan.data.source == "images"
    ):
        return "spawn"
    for name in _WORKER_MODULES:
        importlib.import_module(name)
    return "fork"


@contextlib.contextmanager
def _watched(
    folder: Path, local: int, ranks: Iterable[int] | None, timeout_seconds: float
) -> Iterator[list[WorkerStalled]]:
    """The workers write heartbeats into ``folder`` (spawned workers inherit os.environ);
    a thread watches them and, on a stall, kills every worker so that the agent stops (or,
    under --max-restarts, restarts the group, which is then watched afresh), and leaves the
    stall in the yielded list for the launch to report, until a restarted group beats.
    ``ranks`` None: this machine's ranks are known once its ``local`` workers have beaten."""
    heartbeats = folder / "heartbeat"
    heartbeats.mkdir()
    known = list(ranks) if ranks is not None else None
    monitors = [StallMonitor(heartbeats, known, timeout_seconds)] if known is not None else []
    stalls: list[WorkerStalled] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_MONITOR_SECONDS):
            if not monitors:
                found = _beating_ranks(heartbeats)
                if len(found) < local:
                    continue
                monitors.append(StallMonitor(heartbeats, found, timeout_seconds))
            monitor = monitors[0]
            stall = monitor.check()
            if stall is None:
                if stalls and monitor.pids():  # a restarted group runs: its own end counts
                    stalls.clear()
                continue
            stalls.append(stall)
            for pid in monitor.pids().values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for path in heartbeats.glob("rank-*"):  # the stopped group's beats
                path.unlink(missing_ok=True)
            monitors.clear()  # the restarted group's ranks are watched afresh
            if known is not None:
                monitors.append(StallMonitor(heartbeats, known, timeout_seconds))

    saved = {name: os.environ.get(name) for name in (HEARTBEAT_DIR, LAUNCHER_PID)}
    os.environ.update({HEARTBEAT_DIR: str(heartbeats), LAUNCHER_PID: str(os.getpid())})
    watcher = threading.Thread(target=watch, name="crosstrain-heartbeat", daemon=True)
    watcher.start()
    try:
        yield stalls
    finally:
        done.set()
        watcher.join()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _temporary_files_in(folder: Path) -> Iterator[None]:
    """This process's temporary files go to the launch folder (removed with it) while the
    agent runs: torch.multiprocessing gives each worker a ``pytorch-errorfile-*.pickle`` for
    its traceback and never removes the file of a worker that raised, so every failed run
    left one per failed rank in /tmp. The workers' own temporary folder is unchanged
    (torch.compile's cache lives there; a forked worker resets it, :func:`worker_main`)."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _beating_ranks(heartbeats: Path) -> list[int]:
    names = (path.name.removeprefix("rank-") for path in heartbeats.glob("rank-*"))
    return sorted(int(name) for name in names if name.isdigit())


def _quiet_elastic_logs() -> None:
    """The agent logs a failed worker's traceback itself; it reaches the user once, as WorkerError.
    torch gives some of its module loggers their own level (so the parent's is not inherited):
    those are set too."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
    for name in {*prefixes, *names}:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _worker_error(failure: ChildFailedError) -> WorkerError:
    rank, first = min(_every_failure(failure).items(), key=lambda item: (_blame(item[1]), item[0]))
    if first.exitcode < 0:  # killed by a signal: said as the shared launcher says it
        return WorkerError(rank, describe_exit(first.exitcode))
    message = first.message if isinstance(first.message, str) else str(first.message.get("message", ""))
    traceback_text = ""
    if isinstance(first.error_file_data, dict):
        extra = first.error_file_data.get("message", {})
        if isinstance(extra, dict):
            traceback_text = str(extra.get("extraInfo", {}).get("py_callstack", ""))
    if not message:
        message = f"exit code {first.exitcode}"
    line = message.splitlines()[0]
    kind, _, rest = line.partition(": ")
    if kind in _bad_input_errors():  # the shared launcher's line and exit code 2
        return WorkerError(rank, rest, traceback_text, exit_code=BAD_INPUT_EXIT_CODE)
    return WorkerError(rank, line, traceback_text)


def _every_failure(failure: ChildFailedError) -> dict[int, ProcessFailure]:
    """The agent reports the first failed worker its poll finds; when one rank raises and its
    peers fail in the same instant (their collective broke), that may be a peer. So every
    report (``@record``'s error.json) of the failed attempt's workers is read, and the blame
    order picks the cause. The agent keeps them as ``attempt_N/<local rank>/error.json``."""
    failures = dict(failure.failures)
    for rank, seen in failure.failures.items():
        if not seen.error_file:
            continue
        offset = rank - seen.local_rank  # this machine's ranks are consecutive
        for report in Path(seen.error_file).parent.parent.glob("*/error.json"):
            local_rank = int(report.parent.name)
            failures.setdefault(
                offset + local_rank,
                ProcessFailure(local_rank=local_rank, pid=-1, exitcode=1, error_file=str(report)),
            )
    return failures


def _bad_input_errors() -> set[str]:
    """The names, as torch's error file gives an exception's type, of the errors of bad input
    (exit code 2: a plan field, a data file, a checkpoint), which the shared launcher reads
    from the worker's own report."""
    found, unseen = set(), [CrosstrainError]
    while unseen:
        kind = unseen.pop()
        unseen.extend(kind.__subclasses__())
        if kind.exit_code == BAD_INPUT_EXIT_CODE:
            found.add(kind.__name__)
    return found


def _blame(failure: ProcessFailure) -> tuple[int, float]:
    """The shared launcher's order (:func:`blame_order`); a report is the error file that
    ``@record`` writes, whose message is a mapping (a signal's made-up message is a string).
    When it was written is the file's own time: the report's timestamp counts whole seconds,
    and a raising rank and the peer it broke report within milliseconds."""
    data = failure.error_file_data
    reported = isinstance(data, dict) and isinstance(data.get("message"), dict)
    return blame_order(failure.exitcode, os.stat(failure.error_file).st_mtime if reported else None)
