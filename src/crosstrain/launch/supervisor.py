"""Start worker processes, watch them, and end the job on the first failure or stall.

What torchrun's elastic agent is for torch, without a framework: tf, the jax example and
any third-party backend that trains in subprocesses describe their workers
(:class:`WorkerSpec`) and call :func:`run_workers`. It

- starts each worker in its own process group, killed with the launcher (parent-death signal);
- watches exit codes, result and error files, and every rank's heartbeat;
- on a failure, a stall (no heartbeat for ``timeout_seconds``), SIGINT or SIGTERM, stops
  every worker (SIGTERM, then SIGKILL) and raises :class:`WorkerError`,
  :class:`WorkerStalled` or :class:`Interrupted`;
- with ``max_restarts``, after a worker's failure or stall, stops the group and starts it
  again (fresh specs, so fresh ports; fresh heartbeats; :data:`RESTART_COUNT` set, so each
  worker resumes through :func:`crosstrain.core.run.worker.attempt_job`), up to that many times;
  bad input (exit code 2) and a signal to the launcher end the job at once;
- removes its temporary folder on every exit it sees, and the folders of launchers that
  were killed outright (SIGKILL leaves nobody to clean up) the next time one starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from crosstrain.core.errors import BAD_INPUT_EXIT_CODE, WorkerError
from crosstrain.core.run.checkpoint import complete_checkpoints
from crosstrain.core.run.heartbeat import HEARTBEAT_DIR
from crosstrain.launch.monitor import StallMonitor
from crosstrain.launch.outcomes import (
    error_path,
    first_failure,
    log_failure,
    only_echoes,
    read_result,
    result_path,
)
from crosstrain.launch.process import interrupts_raise, start_process, stop_processes
from crosstrain.launch.worker import LAUNCH_DIR, LAUNCH_RANK, RESTART_COUNT

POLL_SECONDS = 0.1
EXIT_GRACE_SECONDS = 30.0  # a worker that reported its result but does not exit is stopped
#: how long ranks that aborted themselves (SIGABRT, no report) wait for a peer's failure
#: they may echo before they are blamed
ECHO_GRACE_SECONDS = 3.0
_FOLDER = re.compile(r"crosstrain-[\w.]+-(\d+)-")


@attrs.frozen
class WorkerSpec:
    """One worker process: the rank it reports as, its command and its environment."""

    rank: int
    command: Sequence[str]
    environment: Mapping[str, str]


@contextlib.contextmanager
def launch_folder(name: str) -> Iterator[Path]:
    """A temporary folder for one launch, removed afterwards; ``name`` is the backend."""
    remove_orphaned_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"crosstrain-{name}-{os.getpid()}-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_orphaned_folders(root: Path | None = None) -> None:
    """Remove launch folders whose launcher no longer runs (it was killed by SIGKILL)."""
    root = Path(root or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for folder in root.glob("crosstrain-*-*-*"):
            match = _FOLDER.match(folder.name)
            if match and folder.is_dir() and not _alive(int(match.group(1))):
                shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


#: the workers of one (re)start, made afresh for each: restart number -> specs
SpecFactory = Callable[[int], Sequence[WorkerSpec]]


def run_workers(
    specs: Sequence[WorkerSpec] | SpecFactory,
    folder: Path,
    timeout_seconds: float,
    max_restarts: int = 0,
    run_folder: Path | None = None,
) -> dict[int, dict[str, Any]]:
    """Run the workers to the end; return each rank's result (the dict its train returned).

    ``specs`` may be a function of the restart number (0 for the first start), for workers
    that need something fresh each time, such as free ports. ``run_folder`` (the job's
    output folder) names, in the restart line, the checkpoint the group resumes from, and
    receives each failed rank's traceback (:func:`log_failure`)."""
    make_specs: SpecFactory = specs if callable(specs) else (lambda restart: specs)
    restart = 0
    with interrupts_raise():  # a signal raises Interrupted, which no restart catches
        while True:
            try:
                return _run_group(make_specs(restart), folder, timeout_seconds, restart)
            except WorkerError as failure:
                if run_folder is not None:
                    log_failure(failure, run_folder)
                if failure.exit_code == BAD_INPUT_EXIT_CODE or restart == max_restarts:
                    raise
                restart += 1
                _announce_restart(failure, restart, max_restarts, run_folder)


def _run_group(
    specs: Sequence[WorkerSpec], folder: Path, timeout_seconds: float, restart: int
) -> dict[int, dict[str, Any]]:
    """One start of the whole group, with the reports of an earlier start removed."""
    heartbeats = folder / f"heartbeat-{restart}"
    heartbeats.mkdir(exist_ok=True)
    for spec in specs:
        for path in (result_path(folder, spec.rank), error_path(folder, spec.rank)):
            path.unlink(missing_ok=True)
    processes: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for spec in specs:
            environment = {
                **spec.environment,
                LAUNCH_DIR: str(folder),
                LAUNCH_RANK: str(spec.rank),
                HEARTBEAT_DIR: str(heartbeats),
                RESTART_COUNT: str(restart),
            }
            processes[spec.rank] = start_process(spec.command, environment)
        supervise(processes, folder, StallMonitor(heartbeats, processes, timeout_seconds))
    finally:
        stop_processes(list(processes.values()))
    return {rank: read_result(folder, rank) for rank in processes}


def _announce_restart(failure: WorkerError, restart: int, max_restarts: int, run_folder: Path | None) -> None:
    """One line on stderr per restart; the last failure is the job's error, reported once."""
    checkpoints = complete_checkpoints(run_folder) if run_folder is not None else []
    where = f"from step {checkpoints[-1][0]}" if checkpoints else "from the start"
    print(
        f"crosstrain: {failure}; restarting the group ({restart} of {max_restarts}) {where}",
        file=sys.stderr,
        flush=True,
    )


def supervise(
    processes: Mapping[int, subprocess.Popen[bytes]], folder: Path, monitor: StallMonitor | None = None
) -> None:
    """Wait until every worker has exited cleanly; raise on the first failure or stall."""
    all_reported_at: float | None = None
    echoes_since: float | None = None
    while True:
        codes = {rank: process.poll() for rank, process in processes.items()}
        failed = [
            rank
            for rank, code in codes.items()
            if code is not None and (code != 0 or not result_path(folder, rank).exists())
        ]
        if failed and None in codes.values() and only_echoes(failed, codes, folder):
            # an abort may echo a peer's death that is still being torn down (a SIGKILLed
            # process with much memory exits after its peers noticed): wait for the cause
            echoes_since = echoes_since or time.monotonic()
            if time.monotonic() - echoes_since < ECHO_GRACE_SECONDS:
                time.sleep(POLL_SECONDS)
                continue
        if failed:
            raise first_failure(failed, codes, folder)
        if all(code == 0 for code in codes.values()):
            return
        if all(result_path(folder, rank).exists() for rank in processes):
            # every rank finished training; one stuck in its framework's shutdown is stopped
            all_reported_at = all_reported_at or time.monotonic()
            if time.monotonic() - all_reported_at > EXIT_GRACE_SECONDS:
                return
        elif monitor is not None and (stall := monitor.check()) is not None:
            raise stall
        time.sleep(POLL_SECONDS)
