"""Run the job in a fresh python whose jax sees ``--nproc`` devices, under crosstrain's
shared launcher.

XLA reads ``--xla_force_host_platform_device_count`` (how many CPU devices jax
shows) from ``XLA_FLAGS`` once, when jax first initialises a backend. The calling
process may already have done that, or may be a notebook that must not be changed,
so the training always runs in a spawned python with the flag in its environment.

:func:`crosstrain.launch.run_workers` watches the worker (its heartbeat, its exit, its
error file) exactly as it watches tf's, so failures, hangs and interrupts end the same
way with the same exit codes, and ``--max-restarts`` starts it again (it then resumes).
This module imports jax only in the worker.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crosstrain import BackendError, Job, PlanError, RunResult, World
from crosstrain.launch import WorkerSpec, launch_folder, run_workers, serve
from crosstrain.launch.worker import restart_count, worker_folder

_JOB_FILE, _PATH_FILE = "job.pickle", "sys_path.json"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def launch(job: Job) -> RunResult:
    check_job(job)
    with launch_folder("jax") as work:
        (work / _JOB_FILE).write_bytes(pickle.dumps(job))
        # like multiprocessing's spawn: the worker imports what this process can import
        (work / _PATH_FILE).write_text(json.dumps(sys.path), encoding="utf-8")
        command = [sys.executable, "-m", "crosstrain_jax.launch"]
        specs = [WorkerSpec(0, command, worker_environment(job))]
        out = Path(job.out_dir)
        results = run_workers(specs, work, job.launch.timeout_seconds, job.launch.max_restarts, out)
        return RunResult(results[0], job.out_dir)


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
        raise PlanError(
            "the jax backend builds models from neutral layers only; model.native is not supported",
            field="model.native",
            source=plan.source,
        )


def worker_environment(job: Job) -> dict[str, str]:
    """This environment, with XLA told to show ``job.replicas`` CPU devices."""
    env = dict(os.environ)
    flags = [
        flag for flag in env.get("XLA_FLAGS", "").split() if not flag.startswith(_DEVICE_COUNT_FLAG)
    ]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={job.replicas}"])
    if job.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"  # do not even probe for an accelerator
    return env


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
                raise BackendError(
                    "--device gpu, but jax sees no GPU "
                    "(install a CUDA jax: pip install 'jax[cuda12]')"
                ) from None
            found = jax.devices("cpu")
    if len(found) < count:
        raise BackendError(
            f"--nproc {count} needs {count} {found[0].platform} devices; jax sees {len(found)}"
        )
    return list(found[:count])


def _train() -> dict[str, Any]:
    from crosstrain import attempt_job, run_worker

    from crosstrain_jax.strategy import JaxStrategy

    work = worker_folder()
    sys.path[:] = json.loads((work / _PATH_FILE).read_text(encoding="utf-8"))
    job: Job = attempt_job(pickle.loads((work / _JOB_FILE).read_bytes()), restart_count())
    devices = select_devices(job.device, job.replicas)
    world = World(
        process_index=0,
        process_count=1,
        local_replicas=len(devices),
        device=str(devices[0].platform),
    )
    return run_worker(JaxStrategy(world, devices), job)


def main(argv: Sequence[str] | None = None) -> None:
    """The worker: train, then leave the summary (or the error) for the launcher."""
    serve(_train)


if __name__ == "__main__":
    main()
