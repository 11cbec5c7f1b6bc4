"""crosstrain.fit(): the CLI's `run`, from Python."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from crosstrain.core.convert import structure_plan, unstructure_plan
from crosstrain.core.data import load_datasets
from crosstrain.core.errors import BackendError, InputError, NonFiniteLossError
from crosstrain.core.plan import Plan, check_world_fits, validate_plan
from crosstrain.core.planfile import apply_override, load_plan
from crosstrain.core.resume import check_backend_supports
from crosstrain.core.runfolder import open_run_folder, write_run_plan
from crosstrain.core.strategy import (
    ChecksJob,
    DeviceChoice,
    DistributedStrategy,
    Job,
    PluginSelection,
    SpansNodes,
)
from crosstrain.core.vocabulary import SpeaksVocabulary, check_plan_vocabulary
from crosstrain.launch.environments import check_cluster, detect_environment
from crosstrain.plugins.manager import CrosstrainPluginManager, get_backend, hook_relay, make_plugin_manager


def prepare_plan(plan: Plan | str | Path, overrides: Iterable[str] = ()) -> Plan:
    """A validated Plan from a file or a Plan object, with ``--set`` style overrides applied."""
    if not isinstance(plan, Plan):
        return load_plan(plan, overrides)
    overrides = list(overrides)
    if overrides:
        raw = unstructure_plan(plan)
        for override in overrides:
            apply_override(raw, override, plan.source)
        plan = structure_plan(raw, source=plan.source)
    validate_plan(plan)
    return plan


def default_out_dir(plan: Plan, backend: str, replicas: int) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path("runs") / f"{plan.name}-{backend}-x{replicas}-{stamp}"


def make_job(
    plan: Plan,
    backend: str,
    replicas: int | None = None,
    workers: int | None = None,
    device: DeviceChoice = "auto",
    out: str | Path | None = None,
    options: Mapping[str, Any] | None = None,
    plugins: PluginSelection = PluginSelection(),
    timeout_seconds: float = 300.0,
    resume: bool = False,
    max_restarts: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str = "",
) -> Job:
    """Check everything that can be checked before a process starts, then describe the job.
    The run folder is ``out``, else the plan's ``output.dir``, else a new one under runs/.
    ``replicas`` None: one per machine, or what an outside launcher (torchrun, SLURM) started."""
    replicas = check_cluster(detect_environment(), replicas, nnodes, node_rank, rdzv_endpoint)
    check_numbers(replicas, workers, timeout_seconds, max_restarts)
    check_world_fits(plan, replicas)
    load_datasets(plan)  # the data must load and fit the model before any worker starts
    if out is None and plan.output.dir is not None:
        out = plan.output.dir
    out_dir = Path(out) if out is not None else default_out_dir(plan, backend, replicas)
    return Job(
        plan=plan,
        backend=backend,
        replicas=replicas,
        workers=workers,
        device=device,
        out_dir=str(out_dir.resolve()),
        options=dict(options or {}),
        plugins=plugins,
        timeout_seconds=timeout_seconds,
        resume=resume,
        max_restarts=max_restarts,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        load_hooks=hook_relay,
    )


def check_numbers(replicas: int, workers: int | None, timeout_seconds: float, max_restarts: int = 0) -> None:
    """The layout and timeout numbers, refused with the flag's name before anything starts."""
    if replicas < 1:
        raise InputError(f"--nproc {replicas}: the number of replicas must be at least 1")
    if workers is not None and workers < 1:
        raise InputError(f"--workers {workers}: the number of processes must be at least 1")
    if not math.isfinite(timeout_seconds) or timeout_seconds <= 0:
        raise InputError(f"--timeout {timeout_seconds:g}: must be a positive number of seconds")
    if max_restarts < 0:
        raise InputError(f"--max-restarts {max_restarts}: must be 0 or more")


def check_out_dir(out_dir: str | Path) -> None:
    """The output folder can be created and written, checked before any worker starts
    (a worker would find out only when it first writes, after the whole start-up)."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {path}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"--out {path}: cannot create the folder: {error.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"--out {path}: the folder is not writable")


def check_backend_can_run(strategy: DistributedStrategy, job: Job) -> None:
    """What the backend declares it cannot build or lay out is refused here, before the
    output folder exists or any process starts."""
    if isinstance(strategy, SpeaksVocabulary):
        check_plan_vocabulary(job.plan, strategy.vocabulary(), job.backend)
    if isinstance(strategy, ChecksJob):
        strategy.check_job(job)
    check_backend_supports(strategy, job.plan, job.backend, job.max_restarts)
    check_backend_spans(strategy, job)


def check_backend_spans(strategy: DistributedStrategy, job: Job) -> None:
    """A backend that runs on one machine is refused more machines, and an outside
    launcher's group (which would otherwise run as that many separate jobs)."""
    if isinstance(strategy, SpansNodes) and strategy.spans_nodes():
        return
    if job.nnodes > 1:
        raise BackendError(f"--nnodes {job.nnodes}: the {job.backend} backend runs on one machine")
    environment = detect_environment()
    if not environment.starts_processes and environment.world_size() > 1:
        raise BackendError(
            f"{environment.describe()}, but the {job.backend} backend runs on one machine "
            f"in one launch: run it once, outside that launcher"
        )


def owns_run_folder(job: Job) -> bool:
    """Whether this process checks, clears and locks the run folder. Under an outside
    launcher every process runs the CLI, and on ``--nnodes`` machines every node's
    launcher does: rank 0's (node 0's) minds the folder, the others leave it to it."""
    return job.node_rank == 0 and detect_environment().rank() == 0


def run_job(
    job: Job, manager: CrosstrainPluginManager | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """Check the plan and layout against the backend, create (or check, or clear) the run
    folder and hold its lock, launch; return rank 0's summary. A run that met a non-finite
    loss raises :class:`NonFiniteLossError` once its summary is written."""
    manager = manager or make_plugin_manager(job.plugins)
    strategy = get_backend(manager, job.backend)()
    check_backend_can_run(strategy, job)  # what the backend refuses writes nothing
    check_out_dir(job.out_dir)
    if owns_run_folder(job):
        with open_run_folder(Path(job.out_dir), resume=job.resume, overwrite=overwrite):
            write_run_plan(Path(job.out_dir), job.plan)  # what evaluate, predict and export read
            summary = dict(strategy.launch(job).summary)
    else:
        summary = dict(strategy.launch(job).summary)
    stopped = summary.get("stopped") or {}
    if stopped.get("kind") == "nonfinite":
        raise NonFiniteLossError(
            f"rank {stopped.get('rank', 0)}: {stopped['reason']}; training stopped there "
            f"(train.on_nonfinite = 'stop'); checkpoints and logs up to it are kept in {job.out_dir}"
        )
    return summary


def fit(
    plan: Plan | str | Path,
    backend: str = "torch",
    nproc: int | None = None,
    *,
    workers: int | None = None,
    device: DeviceChoice = "auto",
    out: str | Path | None = None,
    overrides: Iterable[str] = (),
    plugins: PluginSelection = PluginSelection(),
    options: Mapping[str, Any] | None = None,
    timeout_seconds: float = 300.0,
    resume: bool = False,
    overwrite: bool = False,
    max_restarts: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str = "",
) -> dict[str, Any]:
    """Train ``plan`` on ``backend`` with ``nproc`` replicas (default: one per machine, or
    what an outside launcher started); return the run's summary. ``nnodes``, ``node_rank``
    and ``rdzv_endpoint`` spread them over machines, as the CLI's flags do.
    ``resume`` continues ``out``'s last checkpoint; ``overwrite`` replaces an earlier run
    there; ``max_restarts`` restarts a failed worker group from its last checkpoint."""
    prepared = prepare_plan(plan, overrides)
    manager = make_plugin_manager(plugins)
    get_backend(manager, backend)  # fail on an unknown backend before writing anything
    job = make_job(
        prepared,
        backend,
        nproc,
        workers,
        device,
        out,
        options,
        plugins,
        timeout_seconds,
        resume,
        max_restarts,
        nnodes,
        node_rank,
        rdzv_endpoint,
    )
    return run_job(job, manager, overwrite)
