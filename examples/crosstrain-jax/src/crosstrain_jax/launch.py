"""Run the job in a fresh python whose jax sees ``--nproc`` devices, and watch it.

XLA reads ``--xla_force_host_platform_device_count`` (how many CPU devices jax
shows) from ``XLA_FLAGS`` once, when jax first initialises a backend. The calling
process may already have done that, or may be a notebook that must not be changed,
so the training always runs in a spawned python with the flag in its environment.

The launcher watches the worker: a worker that exits without a result, or stops
touching its heartbeat file for ``job.timeout_seconds``, ends the job with a
:class:`WorkerError`; an error raised in the worker comes back with its traceback,
shown once by the CLI. This module imports jax only in the worker.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crosstrain.core.errors import BackendError, CrosstrainError, PlanError, WorkerError
from crosstrain.core.strategy import Job, RunResult, World

_JOB_FILE, _PATH_FILE, _RESULT_FILE, _HEARTBEAT_FILE = (
    "job.pickle", "sys_path.json", "result.json", "heartbeat")
_POLL_SECONDS = 0.1
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
#: errors of bad input keep their own type (and exit code 2) across the process boundary
_USER_ERRORS: dict[str, type[CrosstrainError]] = {
    "PlanError": PlanError, "BackendError": BackendError}


def launch(job: Job) -> RunResult:
    check_job(job)
    with tempfile.TemporaryDirectory(prefix="crosstrain-jax-") as folder:
        work = Path(folder)
        (work / _JOB_FILE).write_bytes(pickle.dumps(job))
        # like multiprocessing's spawn: the worker imports what this process can import
        (work / _PATH_FILE).write_text(json.dumps(sys.path), encoding="utf-8")
        (work / _HEARTBEAT_FILE).touch()
        process = subprocess.Popen([sys.executable, "-m", "crosstrain_jax.launch", folder],
                                   env=worker_environment(job))
        try:
            _watch(process, work / _HEARTBEAT_FILE, job.timeout_seconds)
        finally:
            _stop(process)
        return RunResult(_read_result(work, process.returncode), job.out_dir)


def check_job(job: Job) -> None:
    """The layout and model kinds this backend cannot run, refused before a process starts.
    (Layer types, losses, optimizers and precisions are the vocabulary's to refuse.)"""
    if job.workers not in (None, 1):
        raise BackendError(
            f"--workers {job.workers}: multi-process jax (jax.distributed) is not supported by "
            f"this example backend; it runs one process driving all --nproc devices"
        )
    plan = job.plan
    if plan.model.native is not None:
        raise PlanError("the jax backend builds models from neutral layers only; model.native "
                        "is not supported", field="model.native", source=plan.source)


def worker_environment(job: Job) -> dict[str, str]:
    """This environment, with XLA told to show ``job.replicas`` CPU devices."""
    env = dict(os.environ)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split()
             if not flag.startswith(_DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={job.replicas}"])
    if job.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"  # do not even probe for an accelerator
    return env


def _watch(process: subprocess.Popen[bytes], heartbeat: Path, timeout: float) -> None:
    """Wait for the worker; every train and eval step touches ``heartbeat``."""
    while True:
        try:
            process.wait(timeout=_POLL_SECONDS)
            return
        except subprocess.TimeoutExpired:
            pass
        silent = time.time() - heartbeat.stat().st_mtime
        if silent > timeout:
            raise WorkerError(0, f"the jax worker made no progress for {silent:.0f} s "
                                 f"(timeout {timeout:g} s); it was stopped")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _read_result(work: Path, returncode: int) -> dict[str, Any]:
    path = work / _RESULT_FILE
    report = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if "summary" in report and returncode == 0:
        return dict(report["summary"])
    if "error" in report:
        raise _error_from(report["error"])
    raise WorkerError(0, f"the jax worker {_describe_exit(returncode)} without a result")


def _error_from(error: dict[str, str]) -> CrosstrainError:
    user_error = _USER_ERRORS.get(error["type"])
    if user_error is not None:
        return user_error(error["message"])
    return WorkerError(0, f"{error['type']}: {error['message']}", error["traceback"])


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


# --------------------------------------------------------------------------- in the worker


def select_devices(choice: str, count: int) -> list[Any]:
    """``count`` devices: GPUs for 'gpu' (and for 'auto' when jax has any), else CPUs."""
    import jax

    if choice == "cpu":
        found = jax.devices("cpu")
    else:
        try:
            found = jax.devices("gpu")
        except RuntimeError:
            if choice == "gpu":
                raise BackendError("--device gpu, but jax sees no GPU "
                                   "(install a CUDA jax: pip install 'jax[cuda12]')") from None
            found = jax.devices("cpu")
    if len(found) < count:
        raise BackendError(f"--nproc {count} needs {count} {found[0].platform} devices; "
                           f"jax sees {len(found)}")
    return list(found[:count])


def _train(work: Path) -> dict[str, Any]:
    from crosstrain.core.worker import run_worker

    from crosstrain_jax.strategy import JaxStrategy

    sys.path[:] = json.loads((work / _PATH_FILE).read_text(encoding="utf-8"))
    job: Job = pickle.loads((work / _JOB_FILE).read_bytes())
    devices = select_devices(job.device, job.replicas)
    world = World(process_index=0, process_count=1, local_replicas=len(devices),
                  device=str(devices[0].platform))
    strategy = JaxStrategy(world, devices, heartbeat=str(work / _HEARTBEAT_FILE))
    return run_worker(strategy, job)


def _write_report(work: Path, report: dict[str, Any]) -> None:
    temporary = work / (_RESULT_FILE + ".tmp")
    temporary.write_text(json.dumps(report), encoding="utf-8")
    os.replace(temporary, work / _RESULT_FILE)


def main(argv: Sequence[str] | None = None) -> int:
    """The worker: train, then leave the summary (or the error) for the launcher."""
    work = Path((sys.argv[1:] if argv is None else argv)[0])
    try:
        summary = _train(work)
    except BaseException as error:  # every failure goes back to the launcher, printed once there
        _write_report(work, {"error": {"type": type(error).__name__, "message": str(error),
                                       "traceback": traceback.format_exc()}})
        return 1
    _write_report(work, {"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
