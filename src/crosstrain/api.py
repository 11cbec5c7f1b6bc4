"""crosstrain.fit(): the CLI's `run`, from Python."""

from __future__ import annotations

import datetime
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from crosstrain.core.admission.checks import admit, owns_run_folder
from crosstrain.core.admission.cluster import Cluster, default_replicas
from crosstrain.core.admission.python_arrays import (
    GivenArrays,
    given_arrays,
    reading_the_arrays,
    write_arrays,
)
from crosstrain.core.admission.runfolder import (
    PLAN_FILE,
    PlanChange,
    check_request,
    check_unclaimed,
    continued_plan,
    open_run_folder,
    read_launch_record,
    read_run_plan,
    write_launch_record,
    write_run_plan,
)
from crosstrain.core.errors import InputError, NonFiniteLossError, RunFolderError
from crosstrain.core.run.job import (
    DEFAULT_BACKEND,
    DEFAULT_DEVICE,
    DEFAULT_NNODES,
    DeviceChoice,
    Job,
    LaunchOptions,
    Layout,
    PluginSelection,
    RunResult,
)
from crosstrain.core.spec.plan import Plan, validate_plan
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan
from crosstrain.core.spec.planfile import apply_override, load_plan
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


def say_on_stderr(line: str) -> None:
    """A note (a damaged checkpoint skipped, a schedule following a new length): one line."""
    print(f"crosstrain: {line}", file=sys.stderr, flush=True)


def plan_to_resume(
    plan: Plan | str | Path | None, overrides: Iterable[str], out: str | Path | None
) -> tuple[Plan, list[str]]:
    """The plan a resumed run continues with (its run folder's ``plan.json``, overrides
    included, changed only where the user says and where a run may change:
    :func:`~crosstrain.core.admission.runfolder.continued_plan`), and the notes to show. ``plan``:
    the plan file given on the command line, if any; ``out``: the run folder (default: the
    plan file's ``output.dir``)."""
    overrides = list(overrides)
    requested = prepare_plan(plan, overrides) if plan is not None else None
    folder = out if out is not None else (requested.output.dir if requested is not None else None)
    if folder is None:
        raise InputError("--resume needs --out DIR, the folder of the run to continue")
    run_dir = Path(folder)
    if not run_dir.is_dir():
        raise RunFolderError(f"--resume: no run folder {run_dir}")
    if requested is not None and not (run_dir / PLAN_FILE).is_file():
        return requested, []  # a folder written before runs kept plan.json: the checkpoint's hash guards it
    if requested is None:
        requested = prepare_plan(read_run_plan(run_dir), overrides)
    continued, changes = continued_plan(run_dir, requested, _stated_fields(plan, overrides))
    return continued, _length_notes(continued, changes)


def _stated_fields(plan: Plan | str | Path | None, overrides: Iterable[str]) -> list[str] | None:
    """The fields the user gives now: each ``--set`` field, and a TOML plan file's keys;
    None: every field (a Python plan or a Plan object states them all)."""
    given = [override.partition("=")[0].strip() for override in overrides]
    if plan is None:
        return given
    if isinstance(plan, Plan) or Path(plan).suffix != ".toml":
        return None
    with Path(plan).open("rb") as handle:
        raw = tomllib.load(handle)  # load_plan read it already: it parses
    return [*_table_fields(raw), *given]


def _table_fields(raw: Mapping[str, Any], prefix: str = "") -> list[str]:
    fields: list[str] = []
    for key, value in raw.items():
        if isinstance(value, Mapping):
            fields += _table_fields(value, f"{prefix}{key}.")
        else:
            fields.append(f"{prefix}{key}")
    return fields


def _length_notes(plan: Plan, changes: list[PlanChange]) -> list[str]:
    """A cosine schedule's curve depends on the run's length: say that a new length bends
    it from the checkpoint on."""
    lengths = [str(change) for change in changes if change.field in ("train.epochs", "train.max_steps")]
    if not lengths or plan.schedule.name != "cosine":
        return []
    return [
        f"schedule.name = 'cosine' depends on the run's length: after the checkpoint the "
        f"learning rate follows the curve of the new length ({'; '.join(lengths)})"
    ]


def default_out_dir(plan: Plan, backend: str, replicas: int) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path("runs") / f"{plan.name}-{backend}-x{replicas}-{stamp}"


def resolve_layout(options: LaunchOptions, recorded: Layout | None, cluster: Cluster) -> Layout:
    """The layout a job runs on, each part resolved once: the flag given, else the layout
    ``recorded`` by the run folder of a resumed run (its last launch's), else the default.
    ``--workers`` splits the replicas into processes for one backend, so it follows the
    record only where the backend and ``--nproc`` do; under an outside launcher (torchrun,
    SLURM) the launcher's processes, not the record, make the world."""
    base = recorded if options.resume else None
    backend = _first(options.backend, base and base.backend, DEFAULT_BACKEND)
    nnodes = _first(options.nnodes, base and base.nnodes, DEFAULT_NNODES)
    from_record = base.replicas if base is not None and cluster.starts_processes else None
    replicas = default_replicas(cluster, _first(options.replicas, from_record, None), nnodes)
    same_split = base is not None and (backend, replicas) == (base.backend, base.replicas)
    recorded_workers = base.workers if base is not None and same_split else None
    workers = _first(options.workers, recorded_workers, None)
    device = _first(options.device, base and base.device, DEFAULT_DEVICE)
    return Layout(backend, replicas, workers, nnodes, device)


def _first(*values: Any) -> Any:
    """The first value that is not None (None if all are)."""
    return next((value for value in values if value is not None), None)


def make_job(plan: Plan, options: LaunchOptions, cluster: Cluster | None = None) -> Job:
    """Describe the job ``options`` ask for, its layout resolved (:func:`resolve_layout`:
    a resumed run reads its run folder's record); nothing is checked here (:func:`admit`
    does, before anything is written or started). ``cluster``: the environment this
    process runs under, detected when not given."""
    cluster = cluster if cluster is not None else detect_environment()
    out = options.out if options.out is not None else plan.output.dir
    recorded = read_launch_record(Path(out)) if options.resume and out is not None else None
    layout = resolve_layout(options, recorded, cluster)
    out_dir = Path(out) if out is not None else default_out_dir(plan, layout.backend, layout.replicas)
    return Job(
        plan=plan,
        layout=layout,
        launch=options,
        out_dir=str(out_dir.resolve()),
        init_from=None if options.init_from is None else str(Path(options.init_from).resolve()),
        resumed_layout=recorded,
        load_hooks=hook_relay,  # each worker loads the same plugins (core may not import the manager)
    )


def run_job(
    job: Job,
    manager: CrosstrainPluginManager | None = None,
    say: Callable[[str], None] = say_on_stderr,
    notes: Iterable[str] = (),
) -> dict[str, Any]:
    """Admit the job (:func:`crosstrain.core.admission.checks.admit`: nothing is written before
    it passes; its notes go to ``say``, and then the caller's ``notes``, so a refused job
    shows its one line alone), create (or check, or clear: ``job.launch.overwrite``) the run
    folder and hold its lock, launch; return rank 0's summary. A run that met a non-finite
    loss raises :class:`NonFiniteLossError` once its summary is written."""
    manager = manager or make_plugin_manager(job.launch.plugins)
    strategy = get_backend(manager, job.backend)()  # an unknown backend: refused before anything is written
    cluster = detect_environment()
    overwrite = job.launch.overwrite
    job = admit(job, strategy, cluster, overwrite=overwrite, say=say)
    for note in notes:
        say(note)
    if owns_run_folder(job, cluster):
        with open_run_folder(Path(job.out_dir), resume=job.launch.resume, overwrite=overwrite):
            # what evaluate, predict, export and a later --resume read
            write_run_plan(Path(job.out_dir), job.plan, job.init_from, job.table_statistics)
            write_launch_record(Path(job.out_dir), job.layout)
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


def run_plan(
    plan: Plan | str | Path | None,
    options: LaunchOptions,
    overrides: Iterable[str] = (),
    manager: CrosstrainPluginManager | None = None,
    *,
    no_plan: str,
    arrays: GivenArrays | None = None,
) -> RunResult:
    """``crosstrain run`` and :func:`fit`: prepare the plan (a resumed run's own, with the
    notes a new length brings: :func:`plan_to_resume`), make the job, admit it and launch
    (:func:`run_job`); rank 0's summary and the run folder. ``no_plan``: the line that
    refuses a new run without a plan (each caller names its own way to give one);
    ``arrays``: the rows to train on, written into the run folder and read as ``.npy``."""
    notes: list[str] = []
    if options.resume:
        prepared, notes = plan_to_resume(plan, overrides, options.out)
    elif plan is None:
        raise InputError(no_plan)
    else:
        prepared = prepare_plan(plan, overrides)
    manager = manager or make_plugin_manager(options.plugins)
    job = make_job(prepared, options)  # the layout resolved: flags, else a resumed run's own, else defaults
    if arrays is not None:
        job = _with_arrays(job, arrays)
    return RunResult(run_job(job, manager, notes=notes), job.out_dir)


def _with_arrays(job: Job, arrays: GivenArrays) -> Job:
    """The job reading ``arrays``, written into its run folder once the folder is known to
    take a new run (nothing of an earlier run there is touched when it does not)."""
    out_dir = Path(job.out_dir)
    check_request(out_dir, job.launch.resume, job.launch.overwrite)
    check_unclaimed(out_dir, job.launch.overwrite)
    fields = write_arrays(out_dir, arrays)
    return attrs.evolve(job, plan=reading_the_arrays(job.plan, fields))


#: what each of :func:`fit`'s launch keywords is when not given: the record's defaults
_NOT_GIVEN = LaunchOptions()


def fit(
    plan: Plan | str | Path | None,
    backend: str | None = _NOT_GIVEN.backend,
    nproc: int | None = _NOT_GIVEN.replicas,
    *,
    workers: int | None = _NOT_GIVEN.workers,
    device: DeviceChoice | None = _NOT_GIVEN.device,
    out: str | Path | None = _NOT_GIVEN.out,
    overrides: Iterable[str] = (),
    plugins: PluginSelection = _NOT_GIVEN.plugins,
    options: Mapping[str, Any] | None = None,
    timeout_seconds: float = _NOT_GIVEN.timeout_seconds,
    resume: bool = _NOT_GIVEN.resume,
    overwrite: bool = _NOT_GIVEN.overwrite,
    max_restarts: int = _NOT_GIVEN.max_restarts,
    nnodes: int | None = _NOT_GIVEN.nnodes,
    node_rank: int = _NOT_GIVEN.node_rank,
    rdzv_endpoint: str = _NOT_GIVEN.rdzv_endpoint,
    init_from: str | Path | None = _NOT_GIVEN.init_from,
    x: Any = None,
    y: Any = None,
    eval: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """Train ``plan`` on ``backend`` (default torch) with ``nproc`` replicas (default: one
    per machine, or what an outside launcher started) on ``device`` (default auto); return
    the run's summary. ``nnodes`` (default 1), ``node_rank`` and ``rdzv_endpoint`` spread
    them over machines, as the CLI's flags do.
    ``resume`` continues the run in ``out`` from its newest intact checkpoint, with the plan
    it was started with (``plan`` may be None; ``overrides`` may change its output and
    length), on its own layout where ``backend``, ``nproc``, ``workers``, ``device`` and
    ``nnodes`` are left None (its run folder's ``launch.json``); ``overwrite`` replaces an
    earlier run there; ``max_restarts`` restarts a failed worker group from its last
    checkpoint; ``init_from`` starts a new run from another run's weights (a run folder, a
    checkpoint folder or a .safetensors file).
    ``x``, ``y`` and ``eval=(x_eval, y_eval)`` train on arrays held in Python instead of the
    plan's data: numpy, or any array that speaks DLPack or ``__array__`` (torch, tf, jax,
    CuPy), copied to the host once, checked against the plan (a bad one is refused before
    anything starts) and written once into the run folder's ``arrays/`` as ``.npy`` files
    every worker memory-maps (:mod:`crosstrain.core.admission.python_arrays`); without
    ``eval``, the plan's ``data.eval_fraction`` of the rows is held out. The keywords are
    :class:`~crosstrain.core.run.job.LaunchOptions`' fields (``nproc``: ``replicas``)."""
    asked = LaunchOptions(
        backend=backend,
        replicas=nproc,
        workers=workers,
        device=device,
        out=out,
        options=options or {},
        plugins=plugins,
        timeout_seconds=timeout_seconds,
        resume=resume,
        max_restarts=max_restarts,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        init_from=init_from,
        overwrite=overwrite,
    )
    no_plan = "fit: a plan is needed (only resume=True reads the run folder's own)"
    arrays = None
    if x is not None or y is not None or eval is not None:
        if resume:
            raise InputError(
                "fit: resume=True continues on the arrays its run folder holds; leave x and y out"
            )
        if plan is None:
            raise InputError(no_plan)
        arrays = given_arrays(prepare_plan(plan, overrides), x, y, eval)
    return dict(run_plan(plan, asked, overrides, no_plan=no_plan, arrays=arrays).summary)
