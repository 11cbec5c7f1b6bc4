"""crosstrain.fit(): the CLI's `run`, from Python."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from crosstrain.core.admission import admit, owns_run_folder
from crosstrain.core.cluster import Cluster, default_replicas
from crosstrain.core.convert import structure_plan, unstructure_plan
from crosstrain.core.errors import NonFiniteLossError
from crosstrain.core.plan import Plan, validate_plan
from crosstrain.core.planfile import apply_override, load_plan
from crosstrain.core.runfolder import open_run_folder, write_run_plan
from crosstrain.core.strategy import (
    DeviceChoice,
    Job,
    PluginSelection,
)
from crosstrain.launch.environments import detect_environment
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


@attrs.frozen
class LaunchOptions:
    """How to launch a plan: the CLI's ``run`` flags as one record (``crosstrain.fit``'s
    keywords). ``replicas`` None: one per machine, or what an outside launcher (torchrun,
    SLURM) started; ``out`` None: the plan's ``output.dir``, else a new folder under runs/."""

    backend: str = "torch"
    replicas: int | None = None
    workers: int | None = None
    device: DeviceChoice = "auto"
    out: str | Path | None = None
    #: plugins' option values (their argparse dests), reaching every hook as ``context.options``
    options: Mapping[str, Any] = attrs.field(factory=dict)
    plugins: PluginSelection = PluginSelection()
    timeout_seconds: float = 300.0
    resume: bool = False
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""


def make_job(plan: Plan, options: LaunchOptions, cluster: Cluster | None = None) -> Job:
    """Describe the job ``options`` ask for; nothing is checked here (:func:`admit` does,
    before anything is written or started). ``cluster``: the environment this process runs
    under, detected when not given."""
    cluster = cluster if cluster is not None else detect_environment()
    replicas = default_replicas(cluster, options.replicas, options.nnodes)
    out = options.out if options.out is not None else plan.output.dir
    out_dir = Path(out) if out is not None else default_out_dir(plan, options.backend, replicas)
    return Job(
        plan=plan,
        backend=options.backend,
        replicas=replicas,
        workers=options.workers,
        device=options.device,
        out_dir=str(out_dir.resolve()),
        options=dict(options.options),
        plugins=options.plugins,
        timeout_seconds=options.timeout_seconds,
        resume=options.resume,
        max_restarts=options.max_restarts,
        nnodes=options.nnodes,
        node_rank=options.node_rank,
        rdzv_endpoint=options.rdzv_endpoint,
        load_hooks=hook_relay,  # each worker loads the same plugins (core may not import the manager)
    )


def run_job(
    job: Job, manager: CrosstrainPluginManager | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """Admit the job (:func:`crosstrain.core.admission.admit`: nothing is written before
    it passes), create (or check, or clear) the run folder and hold its lock, launch;
    return rank 0's summary. A run that met a non-finite loss raises
    :class:`NonFiniteLossError` once its summary is written."""
    manager = manager or make_plugin_manager(job.plugins)
    strategy = get_backend(manager, job.backend)()
    cluster = detect_environment()
    admit(job, strategy, cluster, overwrite=overwrite)
    if owns_run_folder(job, cluster):
        with open_run_folder(Path(job.out_dir), resume=job.resume, overwrite=overwrite):
            write_run_plan(Path(job.out_dir), job.plan)  # what evaluate, predict and export read
            summary = dict(strategy.launch(job).summary)
    else:
        Path(job.out_dir).mkdir(parents=True, exist_ok=True)  # rank 0's machine minds its contents
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
    launch_options = LaunchOptions(
        backend=backend,
        replicas=nproc,
        workers=workers,
        device=device,
        out=out,
        options=dict(options or {}),
        plugins=plugins,
        timeout_seconds=timeout_seconds,
        resume=resume,
        max_restarts=max_restarts,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
    )
    job = make_job(prepared, launch_options)
    return run_job(job, manager, overwrite)
