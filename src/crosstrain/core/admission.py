"""The admission step: every check a job must pass before its run folder is touched or any
process starts, in one place and one order.

:func:`admit` asks, in this order, and raises the first problem it meets (each an error
of :mod:`crosstrain.core.errors` with exit code 2, one line naming the flag or the field):

1. the backend's framework imports (its optional package: ``pip install 'crosstrain[tf]'``);
2. the cluster: ``--nproc``, ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint``
   against each other and against an outside launcher's processes (torchrun, SLURM, ...);
3. the numbers: replicas, processes, timeout and restarts in range;
4. the plan against the world: the global batch splits into replicas x accumulation steps;
5. the data: it loads and fits the model (read only);
6. the plan against the backend's tables: every layer, loss, optimizer and precision has
   a builder (:class:`~crosstrain.core.vocabulary.SpeaksVocabulary`);
7. the backend's own check of the job (:class:`~crosstrain.core.strategy.ChecksJob`: its
   layout on its devices, what it cannot compile);
8. the capabilities the job needs of the backend (restarts, resumable checkpoints, data
   on the device, skipped steps: :func:`~crosstrain.core.resume.check_backend_supports`)
   and across machines (:class:`~crosstrain.core.strategy.SpansNodes`);
9. the output folder: it is one, or can be made, and can be written (nothing is created);
10. a resumed run: its folder holds a complete checkpoint, written by this plan (only
    where this process minds the run folder).

The cheap checks of the flags come first, those that read files last. Core sits below
launch, so the caller hands in the cluster it detected (:class:`~crosstrain.core.cluster.Cluster`);
the default is this machine with no outside launcher.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

from crosstrain.core.checkpoint import check_written_by, last_checkpoint
from crosstrain.core.cluster import Cluster, ThisMachine, mismatch, parse_endpoint
from crosstrain.core.data import load_datasets
from crosstrain.core.errors import BackendError, InputError
from crosstrain.core.plan import check_world_fits
from crosstrain.core.resume import check_backend_supports
from crosstrain.core.runfolder import check_request
from crosstrain.core.strategy import ChecksJob, DistributedStrategy, FindsFramework, Job, SpansNodes
from crosstrain.core.vocabulary import SpeaksVocabulary, check_plan_vocabulary

THIS_MACHINE = ThisMachine()


def admit(
    job: Job, strategy: DistributedStrategy, cluster: Cluster = THIS_MACHINE, *, overwrite: bool = False
) -> None:
    """Run every pre-launch check on ``job`` for ``strategy``, in the module's order; raise
    the first problem. Reads files (data, checkpoints), writes none. ``overwrite``: the run
    replaces the folder's earlier run (``--overwrite``)."""
    check_framework(type(strategy), job.backend)
    check_cluster(cluster, job.replicas, job.nnodes, job.node_rank, job.rdzv_endpoint)
    check_numbers(job.replicas, job.workers, job.timeout_seconds, job.max_restarts)
    check_world_fits(job.plan, job.replicas)
    load_datasets(job.plan)  # the data must load and fit the model before any worker starts
    if isinstance(strategy, SpeaksVocabulary):
        check_plan_vocabulary(job.plan, strategy.vocabulary(), job.backend)
    if isinstance(strategy, ChecksJob):
        strategy.check_job(job)
    check_backend_supports(strategy, job.plan, job.backend, job.max_restarts)
    check_backend_spans(strategy, job, cluster)
    check_out_dir(job.out_dir)
    if owns_run_folder(job, cluster):
        check_resumed_run(job, overwrite)


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
    replicas in all, as :func:`~crosstrain.core.cluster.default_replicas` resolved them)."""
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
    return job.node_rank == 0 and cluster.rank() == 0


def check_resumed_run(job: Job, overwrite: bool = False) -> None:
    """``--resume`` and ``--overwrite`` apart; a resumed folder holds a complete checkpoint
    that this plan wrote (the run folder asks again under its lock)."""
    out_dir = Path(job.out_dir)
    check_request(out_dir, job.resume, overwrite)
    checkpoint = last_checkpoint(out_dir) if job.resume else None
    if checkpoint is not None:
        check_written_by(checkpoint, job.plan)
