"""The admission step: every check a job must pass before its run folder is touched or any
process starts, in one place and one order.

:func:`admit` asks, in this order, and raises the first problem it meets (each an error
of :mod:`crosstrain.core.errors` with exit code 2, one line naming the flag or the field):

1. the backend's framework imports (its optional package: ``pip install 'crosstrain[tf]'``);
2. the cluster: ``--nproc``, ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint``
   against each other and against an outside launcher's processes (torchrun, SLURM, ...);
3. the numbers: replicas, processes, timeout and restarts in range; ``--init-from`` and
   ``--resume`` not together;
4. the plan against the world: the global batch splits into replicas x accumulation steps;
   and the model has a trainable weight (:func:`check_something_to_train`);
5. the data: it loads and fits the model (read only); an image source's every file opens
   as a JPEG or PNG (its header: :func:`check_image_files`);
6. the plan against the backend's tables: every layer, loss, optimizer and precision has
   a builder (:class:`~crosstrain.core.spec.vocabulary.SpeaksVocabulary`), and the backend
   declares the plan's ``train.shard`` mode (a backend without a vocabulary: "none" only);
7. the backend's own check of the job (:class:`~crosstrain.core.run.strategy.ChecksJob`: its
   layout on its devices, what it cannot compile, what it cannot combine with sharding);
8. the capabilities the job needs of the backend (restarts, resumable checkpoints, data
   on the device, skipped steps: :func:`~crosstrain.core.run.resume.check_backend_supports`)
   and across machines (:class:`~crosstrain.core.run.strategy.SpansNodes`);
9. the output folder: it is one, or can be made, and can be written (nothing is created);
10. the weights a new run starts from (``--init-from``, else the plan's ``model.init``;
    the flag wins, with a note through ``say``; a resumed run starts from its checkpoint and
    reads neither): the file reads, and holds exactly the plan's weights, name by name and
    shape by shape (from the file's header; the first mismatch is named);
11. a resumed run (only where this process minds the run folder): its folder holds a
    checkpoint; the newest one that verifies against its manifest is chosen (each newer,
    damaged one is named in one line through ``say``), was written by this plan, and ends
    before the plan's (possibly new) last step; a ``train.max_steps`` given now that lies
    past the end of ``train.epochs`` is refused naming them.

:func:`admit` returns the job as it launches: ``init_from`` is the weights file and
``resume_from`` the chosen checkpoint, so every worker reads exactly what was checked.
(What a resumed run's plan may change is settled before, where the plan is made:
:func:`~crosstrain.core.admission.runfolder.continued_plan`.)

The cheap checks of the flags come first, those that read files last. Core sits below
launch, so the caller hands in the cluster it detected (:class:`~crosstrain.core.admission.cluster.Cluster`);
the default is this machine with no outside launcher.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from pathlib import Path

import attrs

from crosstrain.core.admission.cluster import Cluster, ThisMachine, mismatch, parse_endpoint
from crosstrain.core.admission.runfolder import PLAN_FILE, check_request, read_run_plan
from crosstrain.core.data.batches import Datasets
from crosstrain.core.data.rows import image_rows
from crosstrain.core.data.sources.decoding import opencv
from crosstrain.core.data.sources.images import check_image_headers
from crosstrain.core.errors import BackendError, CheckpointError, InputError, PlanError
from crosstrain.core.run.checkpoint import (
    check_written_by,
    choose_checkpoint,
    read_state,
    tensor_shapes,
    weights_file,
)
from crosstrain.core.run.job import Job
from crosstrain.core.run.length import RunLength
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.resume import check_backend_supports
from crosstrain.core.run.strategy import ChecksJob, DistributedStrategy, FindsFramework, SpansNodes
from crosstrain.core.spec.plan import Plan, check_world_fits
from crosstrain.core.spec.vocabulary import SpeaksVocabulary, check_plan_vocabulary, check_shard_mode

THIS_MACHINE = ThisMachine()


def _silent(line: str) -> None:
    """Where admission's notes go unless the caller shows them."""


def admit(
    job: Job,
    strategy: DistributedStrategy,
    cluster: Cluster = THIS_MACHINE,
    *,
    overwrite: bool = False,
    say: Callable[[str], None] = _silent,
) -> Job:
    """Run every pre-launch check on ``job`` for ``strategy``, in the module's order; raise
    the first problem, else return the job as it launches (its ``init_from`` and
    ``resume_from`` resolved). Reads files (data, checkpoints), writes none.
    ``overwrite``: the run replaces the folder's earlier run (``--overwrite``); ``say``:
    shows a note (a damaged checkpoint skipped) in one line."""
    check_framework(type(strategy), job.backend)
    check_cluster(cluster, job.replicas, job.nnodes, job.launch.node_rank, job.launch.rdzv_endpoint)
    check_numbers(job.replicas, job.workers, job.launch.timeout_seconds, job.launch.max_restarts)
    check_starting_point(job)
    check_world_fits(job.plan, job.replicas)
    check_something_to_train(job.plan)
    # the data must load and fit the model before any worker starts (a resumed run: with the
    # table statistics its folder keeps)
    datasets = load_datasets(job.plan, job.out_dir if job.launch.resume else None)
    if datasets.statistics is not None:
        job = attrs.evolve(job, table_statistics=datasets.statistics.to_json())
    check_image_files(job.plan, datasets)
    vocabulary = strategy.vocabulary() if isinstance(strategy, SpeaksVocabulary) else None
    if vocabulary is not None:
        check_plan_vocabulary(job.plan, vocabulary, job.backend)
    check_shard_mode(job.plan, vocabulary, job.backend)
    if isinstance(strategy, ChecksJob):
        strategy.check_job(job)
    check_backend_supports(strategy, job.plan, job.backend, job.launch.max_restarts)
    check_backend_spans(strategy, job, cluster)
    check_out_dir(job.out_dir)
    start = starting_weights_source(job, say)
    if start is not None:
        source, flag = start
        job = attrs.evolve(job, init_from=str(check_init_from(source, job.plan, flag)))
    if owns_run_folder(job, cluster):
        resume_from = check_resumed_run(job, overwrite, len(datasets.train), say)
        job = attrs.evolve(job, resume_from=None if resume_from is None else str(resume_from))
    return job


def check_something_to_train(plan: Plan) -> None:
    """A model without one trainable weight leaves the optimizer nothing to step (every
    backend's optimizer refuses an empty parameter list, after launch)."""
    if plan.model.native is not None:
        return
    if not any(spec.trainable for spec in plan.model.graph(plan.source).weight_specs().values()):
        raise PlanError(
            "the model has no trainable weights, so there is nothing to train "
            "(a dense, convolution, norm or embedding layer has some)",
            field="model.layers",
            source=plan.source,
        )


def check_image_files(plan: Plan, datasets: Datasets) -> None:
    """Every image file of the plan opens as a JPEG or PNG. Pillow reads each one's header
    only (a few hundred bytes, in a pool of threads), so a file that is not an image, or
    is cut short before its pixels, is named before any worker starts; damaged pixels
    behind a sound header are met when a step decodes them (named with the rank)."""
    if plan.data.source != "images":
        return
    if not plan.data.antialias:
        try:
            opencv()
        except InputError as error:
            raise PlanError(str(error), field="data.antialias", source=plan.source) from None
    eval_field = "data.eval_path" if plan.data.eval_path is not None else "data.path"
    for part, field in ((datasets.train, "data.path"), (datasets.eval, eval_field)):
        rows = None if part is None else image_rows(part.x)
        if rows is not None:
            check_image_headers([str(path) for path in rows.paths], field, plan.source)


def check_framework(strategy: type[DistributedStrategy], backend: str) -> None:
    """The backend's framework imports; else the install command that brings it."""
    status = (
        strategy.framework_installed()
        if isinstance(strategy, FindsFramework)
        else strategy.framework_status()
    )
    if not status.importable:
        raise BackendError(
            f"backend {backend!r} needs its framework, which does not import ({status.problem}); "
            f"install it with: {strategy.install_hint}"
        )


def check_cluster(
    cluster: Cluster, nproc: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str = ""
) -> None:
    """The layout flags against each other and against the cluster (``nproc``: the
    replicas in all, as :func:`~crosstrain.core.admission.cluster.default_replicas` resolved them)."""
    if not cluster.starts_processes:
        _check_outside(cluster, nproc, nnodes)
        return
    if nnodes < 1:
        raise InputError(f"--nnodes {nnodes}: the number of machines must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank {node_rank}: must be from 0 to --nnodes - 1 ({nnodes - 1})")
    if nnodes > 1 and not rdzv_endpoint:
        raise InputError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if rdzv_endpoint:
        parse_endpoint(rdzv_endpoint)
    if nproc % nnodes:
        raise InputError(
            f"--nproc {nproc} is not a multiple of --nnodes {nnodes} "
            f"(--nproc counts the replicas on all machines)"
        )


def _check_outside(cluster: Cluster, nproc: int, nnodes: int) -> None:
    """Under an outside launcher every process runs the CLI; it, not the flags, sets the world."""
    if nnodes != 1:
        raise InputError(
            f"--nnodes {nnodes}, but {cluster.describe()}: it starts the processes on every "
            f"machine, so leave --nnodes, --node-rank and --rdzv-endpoint out"
        )
    if nproc % cluster.world_size():
        raise InputError(mismatch(cluster, nproc))


def check_numbers(replicas: int, workers: int | None, timeout_seconds: float, max_restarts: int = 0) -> None:
    """The layout and timeout numbers, refused with the flag's name."""
    if replicas < 1:
        raise InputError(f"--nproc {replicas}: the number of replicas must be at least 1")
    if workers is not None and workers < 1:
        raise InputError(f"--workers {workers}: the number of processes must be at least 1")
    if not math.isfinite(timeout_seconds) or timeout_seconds <= 0:
        raise InputError(f"--timeout {timeout_seconds:g}: must be a positive number of seconds")
    if max_restarts < 0:
        raise InputError(f"--max-restarts {max_restarts}: must be 0 or more")


def check_starting_point(job: Job) -> None:
    """A run starts from its own checkpoint or from other weights, not both."""
    if job.launch.resume and job.init_from is not None:
        raise InputError(
            "--init-from starts a new run from other weights and --resume continues this one: "
            "they exclude each other"
        )


def check_backend_spans(strategy: DistributedStrategy, job: Job, cluster: Cluster) -> None:
    """A backend that runs on one machine is refused more machines, and an outside
    launcher's group (which would otherwise run as that many separate jobs)."""
    if isinstance(strategy, SpansNodes) and strategy.spans_nodes():
        return
    if job.nnodes > 1:
        raise BackendError(f"--nnodes {job.nnodes}: the {job.backend} backend runs on one machine")
    if not cluster.starts_processes and cluster.world_size() > 1:
        raise BackendError(
            f"{cluster.describe()}, but the {job.backend} backend runs on one machine "
            f"in one launch: run it once, outside that launcher"
        )


def check_out_dir(out_dir: str | Path) -> None:
    """The output folder is one, or can be created, and can be written: checked before any
    worker starts (a worker would find out only when it first writes, after the whole
    start-up), without creating it (the run folder does, once admitted)."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {path}: is a file, not a folder")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise InputError(f"--out {path}: the folder is not writable")
        return
    # the nearest part of the path that exists decides whether the rest can be made
    existing = next(parent for parent in path.absolute().parents if parent.exists())
    problem = None
    if not existing.is_dir():
        problem = errno.ENOTDIR
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = errno.EACCES
    if problem is not None:
        raise InputError(f"--out {path}: cannot create the folder: {os.strerror(problem)}")


def owns_run_folder(job: Job, cluster: Cluster) -> bool:
    """Whether this process checks, clears and locks the run folder. Under an outside
    launcher every process runs the CLI, and on ``--nnodes`` machines every node's
    launcher does: rank 0's (node 0's) minds the folder, the others leave it to it."""
    return job.launch.node_rank == 0 and cluster.rank() == 0


def starting_weights_source(job: Job, say: Callable[[str], None] = _silent) -> tuple[Path, str] | None:
    """Where a new run's weights come from, and what named it: ``--init-from`` (which
    replaces the plan's ``model.init``, as any flag overrides the plan, saying so), else
    ``model.init``; None for seeded weights, and for a resumed run (its checkpoint holds
    them: ``--init-from`` with ``--resume`` is refused before this)."""
    planned = job.plan.model.init
    if job.init_from is not None:
        if planned is not None:
            say(f"--init-from {job.init_from} replaces the plan's model.init ({planned})")
        return Path(job.init_from), "--init-from"
    if planned is None or job.launch.resume:
        return None
    where = f"{job.plan.source}: " if job.plan.source else ""
    return Path(planned), f"{where}model.init ="


def check_init_from(source: Path, plan: Plan, flag: str = "--init-from") -> Path:
    """The weights file ``source`` names (``flag``: ``--init-from``, or the plan's
    ``model.init``, for the errors), holding exactly the plan's weights (names and shapes
    from the file's header, in the model's order); return it."""
    if plan.model.native is not None:
        raise InputError(
            f"{flag} {source}: model.native: a native model's weights have no neutral "
            f"names to check against; --init-from needs a model of layers"
        )
    file = weights_file(source, flag)
    found = tensor_shapes(file)
    needed = plan.model.graph(plan.source).weight_specs()
    for name, spec in needed.items():
        if name not in found:
            raise InputError(
                f"{flag} {file}: has no weight {name!r} (the plan's model has it, shape {list(spec.shape)})"
            )
        if found[name] != tuple(spec.shape):
            raise InputError(
                f"{flag} {file}: weight {name!r} has shape {list(found[name])}, "
                f"the plan's model needs {list(spec.shape)}"
            )
    extra = [name for name in found if name not in needed]
    if extra:
        raise InputError(f"{flag} {file}: holds {extra[0]!r}, which the plan's model has no weight of")
    return file.resolve()


def check_resumed_run(
    job: Job, overwrite: bool = False, train_rows: int | None = None, say: Callable[[str], None] = _silent
) -> Path | None:
    """``--resume`` and ``--overwrite`` apart; a resumed folder holds a checkpoint that
    verifies (the newest such; each newer, damaged one is named through ``say``), that this
    plan wrote, and that ends before the plan's last step (``train_rows``: the train set's
    rows, for that step). Return that checkpoint (the run folder asks again under its lock)."""
    out_dir = Path(job.out_dir)
    check_request(out_dir, job.launch.resume, overwrite)
    if not job.launch.resume:
        return None
    try:
        choice = choose_checkpoint(out_dir)
    except CheckpointError as error:
        raise CheckpointError(f"--resume: {error}") from None
    if choice.path is None:
        return None
    for _, problem in choice.damaged:
        say(f"--resume: {problem}; resuming from {choice.path.name}, the newest intact checkpoint")
    check_written_by(choice.path, job.plan)
    if train_rows is not None:
        ran = read_run_plan(out_dir) if (out_dir / PLAN_FILE).is_file() else None
        check_continues(choice.path, job.plan, train_rows, ran)
    return choice.path


def check_continues(checkpoint: Path, plan: Plan, train_rows: int, ran: Plan | None = None) -> None:
    """A resumed run has steps left: a finished one continues only to a new end, and a
    ``train.max_steps`` given now reaches its step (``ran``: the plan the run ran with, if
    its folder keeps it: a max_steps it already had may lie past the epochs' end, which
    then ends the run, as when it started). Each refusal offers only a change that moves
    the end."""
    step = int(read_state(checkpoint)["step"])
    length = RunLength.of(plan, train_rows)
    new_max_steps = ran is None or ran.train.max_steps != plan.train.max_steps
    epochs_end, max_steps = length.epochs_end, length.max_steps
    if new_max_steps and max_steps is not None and epochs_end is not None and max_steps > epochs_end:
        raise InputError(
            f"--resume: train.max_steps = {max_steps} lies past the end of train.epochs = "
            f"{length.epochs} (step {epochs_end}), which would stop the run first; --set "
            f"train.epochs={length.epochs_needed(max_steps)} too reaches step {max_steps}"
        )
    last = length.total_steps
    if step > last:
        raise InputError(
            f"--resume: {length.reason()} ends the run at step {last}, before its checkpoint's "
            f"step {step}; {length.extension_hint()}"
        )
    if step == last:
        raise InputError(
            f"--resume: the run already ended at step {step} ({length.reason()}); {length.extension_hint()}"
        )
