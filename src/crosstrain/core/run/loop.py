"""fit(): the one training loop, written against the protocol only (its evaluations are
:mod:`crosstrain.core.run.evaluation`'s).

Core owns the weights' first values, the batches and the learning rate; the
backend owns the native model and the collectives. Nothing here knows which
backend runs.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import pluggy

from crosstrain.core.data.batches import (
    ArrayDataset,
    Datasets,
    GlobalSampler,
    StepBatch,
    step_batch,
)
from crosstrain.core.data.sources.images import share_cores
from crosstrain.core.run import resume
from crosstrain.core.run.checkpoint import TensorFile, read_on_every_rank, save_checkpoint
from crosstrain.core.run.context import RunContext
from crosstrain.core.run.evaluation import evaluate
from crosstrain.core.run.heartbeat import Heartbeat
from crosstrain.core.run.job import Job
from crosstrain.core.run.length import RunLength
from crosstrain.core.run.loading import epoch_rows, load_datasets
from crosstrain.core.run.rank_usage import gather_rank_reports, largest_rank_memory, peak_host_memory_bytes
from crosstrain.core.run.schedule import LearningRateSchedule
from crosstrain.core.run.strategy import (
    PREFETCH_STEPS,
    CountsMemory,
    DistributedStrategy,
    PlacesData,
    PrefetchesBatches,
    ReportsDevice,
    ResolvesMetrics,
)
from crosstrain.core.spec.plan import Plan

CHECKPOINT_FILE = "model.safetensors"
_T = TypeVar("_T")


def total_steps(plan: Plan, train_rows: int) -> int:
    """Optimizer steps in the run: the earlier of the epochs' end and max_steps
    (:class:`~crosstrain.core.run.length.RunLength`)."""
    return RunLength.of(plan, train_rows).total_steps


def initial_weights(plan: Plan) -> Mapping[str, np.ndarray]:
    """Seeded numpy weights, the same for every backend (none for a native model), each
    made when it is read: the backend keeps what it needs of each as it loads them."""
    if plan.model.native is not None:
        return {}
    return plan.model.graph().seeded_weights(plan.seed)


def starting_weights(job: Job, resumed: bool) -> Mapping[str, np.ndarray]:
    """What the model is built with: ``job.init_from``'s weights for a new run started from
    another run's (names and shapes were checked before launch; the optimizer starts fresh),
    else the plan's seeded ones (a resumed run then loads its checkpoint over them). Either
    is read a tensor at a time, so no rank holds the whole model on its host to start."""
    if job.init_from is not None and not resumed:
        return TensorFile(Path(job.init_from))
    return initial_weights(job.plan)


def fit(strategy: DistributedStrategy, job: Job, hook: pluggy.HookRelay) -> dict[str, Any]:
    """Train the job's plan on this process's share of the world; return the summary."""
    summary, _ = train(strategy, job, hook)
    return summary


@attrs.define
class _Progress(resume.Position):
    """What the loop has done so far, for the epoch lines, checkpoints and the summary."""

    epochs_run: int = 0
    train_seconds: float = 0.0
    train_samples: int = 0
    last_train_loss: float = float("nan")
    start_step: int = 0
    stopped: dict[str, Any] | None = None  # why training ended early, for the summary
    skipped_steps: int = 0  # steps whose non-finite update was skipped (train.on_nonfinite)
    data_seconds: float = 0.0  # building batches on the host: the device may wait on this
    step_seconds: float = 0.0  # handing steps to the backend and reading their losses
    cpu_seconds: float = 0.0  # CPU time of the whole process (every thread) in the epochs

    def add_data_time(self, since: float) -> float:
        now = time.perf_counter()
        self.data_seconds += now - since
        return now

    def add_step_time(self, since: float) -> float:
        now = time.perf_counter()
        self.step_seconds += now - since
        return now


class NonFiniteLoss(Exception):
    """Inside the loop only: a step's loss was not finite and the plan says stop."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"non-finite loss ({loss}) at step {step}")
        self.step, self.loss = step, loss


class _StopRequested(Exception):
    """Inside the loop only: the ranks agreed that a plugin asked to stop."""


def train(strategy: DistributedStrategy, job: Job, hook: pluggy.HookRelay) -> tuple[dict[str, Any], Any]:
    """fit(), also returning the backend's trained state (for tests and embedding code)."""
    started = time.perf_counter()
    plan, world = job.plan, strategy.world
    share_cores(world.process_count // max(job.nnodes, 1))  # image decoding's worker processes
    datasets = load_datasets(plan, job.out_dir)  # the run folder's table statistics
    sampler = GlobalSampler(len(datasets.train), plan.train.global_batch_size, plan.seed, plan.data.shuffle)
    checkpoint = resume.find_resume_point(job)
    context = RunContext(
        job=job,
        world=world,
        total_steps=total_steps(plan, len(datasets.train)),
        steps_per_epoch=sampler.steps_per_epoch,
        train_rows=len(datasets.train),
        eval_rows=len(datasets.eval) if datasets.eval else 0,
        start_step=checkpoint.state.step if checkpoint else 0,
    )
    heartbeat = Heartbeat(world.process_index)  # a launcher watching names a rank that stops
    try:
        state = strategy.build(plan, starting_weights(job, resumed=checkpoint is not None))
        if isinstance(strategy, PlacesData):
            strategy.place_data(state, datasets)
        progress = _Progress(start_step=context.start_step)
        if checkpoint is not None:
            resume.restore(strategy, state, checkpoint, progress)
            progress.epochs_run = -(-progress.step // max(sampler.steps_per_epoch, 1))  # begun so far
        hook.crosstrain_train_start(context=context)
        if job.init_from is not None and checkpoint is None and datasets.eval is not None:
            _evaluate_start(strategy, state, context, datasets.eval, progress, hook, heartbeat)
        schedule = LearningRateSchedule(plan.optimizer.lr, plan.schedule, context.total_steps)
        _train_epochs(strategy, state, context, datasets, sampler, schedule, progress, hook, heartbeat)
        if progress.stopped is None or progress.stopped["kind"] == "requested":
            _save_final(strategy, state, context, progress, schedule, hook)
        summary = _summary(context, progress, time.perf_counter() - started)
        summary["ranks"] = _rank_reports(strategy, state, progress)
        memory = _memory_per_rank(strategy, state)
        if memory is not None:
            summary["memory_per_rank"] = memory
        hook.crosstrain_train_end(context=context, summary=summary)
    except BaseException as error:
        report_exception(hook, context, error)
        raise
    finally:
        heartbeat.close()
    return summary, state


def _evaluate_start(
    strategy: DistributedStrategy,
    state: Any,
    context: RunContext,
    dataset: ArrayDataset,
    progress: _Progress,
    hook: pluggy.HookRelay,
    heartbeat: Heartbeat,
) -> None:
    """A run started from another run's weights evaluates them before its first step (a
    step-0 eval record): it starts where the source run ended, visibly."""
    progress.eval_metrics = evaluate(strategy, state, dataset, context.plan, heartbeat)
    progress.eval_step = 0
    hook.crosstrain_eval_end(context=context, step=0, epoch=0, metrics=progress.eval_metrics)


def _train_epochs(
    strategy: DistributedStrategy,
    state: Any,
    context: RunContext,
    datasets: Datasets,
    sampler: GlobalSampler,
    schedule: LearningRateSchedule,
    progress: _Progress,
    hook: pluggy.HookRelay,
    heartbeat: Heartbeat,
) -> None:
    """Every epoch from the resumed one on, until the last step, a non-finite loss
    (``train.on_nonfinite = "stop"``) or an agreed stop request. The last step ends the
    epochs (``max_steps`` without ``epochs`` runs as many as it takes)."""
    first_epoch = progress.step // max(sampler.steps_per_epoch, 1)
    try:
        for epoch in itertools.count(first_epoch):
            if progress.step >= context.total_steps:
                break
            _train_epoch(
                strategy, state, context, datasets, sampler, schedule, epoch, progress, hook, heartbeat
            )
    except NonFiniteLoss as error:
        progress.stopped = {"kind": "nonfinite", "reason": str(error), "step": error.step}
        progress.stopped["rank"] = context.world.rank
    except _StopRequested:
        reason = context.stop.reason or "stop requested on another rank"
        progress.stopped = {"kind": "requested", "reason": reason, "step": progress.step}
        if context.stop.restore_best:
            # the last step's state first, so the run ends on a complete checkpoint to continue
            if context.plan.output.checkpoint_every_steps and progress.checkpointed_step != progress.step:
                _save_resumable(strategy, state, context, progress, schedule, hook)
            progress.stopped["restored_step"] = resume.restore_best(strategy, state, context, progress)


def _save_final(
    strategy: DistributedStrategy,
    state: Any,
    context: RunContext,
    progress: _Progress,
    schedule: LearningRateSchedule,
    hook: pluggy.HookRelay,
) -> None:
    """The end-of-run checkpoint (when the plan asks for them: the final state is then always
    a complete checkpoint, which ``--resume`` continues to a new end) and the final weights."""
    plan = context.plan
    # restored best weights beside the last step's optimizer state would not resume exactly
    # (_train_epochs saved the last step's state before restoring them)
    restored = progress.stopped is not None and "restored_step" in progress.stopped
    if plan.output.checkpoint_every_steps and progress.checkpointed_step != progress.step and not restored:
        _save_resumable(strategy, state, context, progress, schedule, hook)
    if plan.output.checkpoint:
        _save_checkpoint(strategy, state, context, progress.step, hook)


def _save_resumable(
    strategy: DistributedStrategy,
    state: Any,
    context: RunContext,
    progress: _Progress,
    schedule: LearningRateSchedule,
    hook: pluggy.HookRelay,
) -> None:
    path = resume.save(strategy, state, context, progress, schedule(progress.step))
    hook.crosstrain_checkpoint_saved(context=context, path=path, step=progress.step)


def _agree_stop(strategy: DistributedStrategy, context: RunContext, heartbeat: Heartbeat) -> None:
    """Every rank calls this at the same points: any rank's request stops them all. The beat
    first: a rank that hangs before this collective (say, in a plugin's hook) is then one
    beat behind the peers waiting in it, and the launcher names that rank, not a peer."""
    heartbeat.beat("sync")
    asked = np.array([1.0 if context.stop.reason is not None else 0.0])
    if float(strategy.all_reduce(asked, op="max")[0]) > 0:
        raise _StopRequested


def report_exception(hook: pluggy.HookRelay, context: RunContext, error: BaseException) -> None:
    """Call crosstrain_exception once per error, however many layers catch and re-raise it."""
    if not getattr(error, "_crosstrain_reported", False):
        error._crosstrain_reported = True  # type: ignore[attr-defined]
        hook.crosstrain_exception(context=context, rank=context.world.process_index, error=error)


def _train_epoch(
    strategy: DistributedStrategy,
    state: Any,
    context: RunContext,
    datasets: Datasets,
    sampler: GlobalSampler,
    schedule: LearningRateSchedule,
    epoch: int,
    progress: _Progress,
    hook: pluggy.HookRelay,
    heartbeat: Heartbeat,
) -> None:
    plan = context.plan
    epoch_started, cpu_started = time.perf_counter(), time.process_time()
    log = _StepLog(strategy, context, hook, progress)
    every = plan.output.checkpoint_every_steps
    if progress.step > epoch * sampler.steps_per_epoch:  # resumed mid-epoch
        log.loss_sum, log.real_rows = progress.epoch_loss_sum, progress.epoch_real_rows
    # a runtime-checkable protocol's isinstance inspects the class at each call: once an epoch
    prefetcher = strategy if isinstance(strategy, PrefetchesBatches) else None
    clock = time.perf_counter()
    try:
        for (index, batch), named in _named_ahead(
            _epoch_steps(context, datasets, sampler, epoch, progress.step), PREFETCH_STEPS
        ):
            if prefetcher is not None:
                for _, upcoming in named:
                    prefetcher.prefetch(state, upcoming)
            lr = schedule(progress.step)
            clock = progress.add_data_time(clock)
            heartbeat.beat("step")
            metrics = strategy.train_step(state, batch, lr)
            progress.step += 1
            heartbeat.beat("idle", progress.step)
            if log.add(_PendingStep(progress.step, epoch, lr, batch.global_real_rows, metrics)):
                _agree_stop(strategy, context, heartbeat)
            ends_epoch = index + 1 == sampler.steps_per_epoch or progress.step >= context.total_steps
            if every and progress.step % every == 0 and not ends_epoch:  # an epoch's end saves after eval
                log.flush()  # no checkpoint of weights a non-finite step has touched
                _save_resumable(strategy, state, context, progress, schedule, hook)
            clock = progress.add_step_time(clock)
        log.flush()  # reads the device: the epoch's time includes all of its work
        progress.add_step_time(clock)
    except BaseException:
        log.flush_what_ran()
        raise
    loss_sum, real_rows = log.loss_sum, log.real_rows
    epoch_seconds = time.perf_counter() - epoch_started
    progress.epochs_run = epoch + 1
    progress.train_seconds += epoch_seconds
    progress.cpu_seconds += time.process_time() - cpu_started
    progress.train_samples += real_rows
    progress.last_train_loss = loss_sum / max(real_rows, 1)
    epoch_metrics = {
        "loss": progress.last_train_loss,
        "samples_per_second": real_rows / max(epoch_seconds, 1e-9),
    }
    is_last = progress.step >= context.total_steps
    every = plan.train.eval_every_epochs
    evaluated = datasets.eval is not None and every > 0 and ((epoch + 1) % every == 0 or is_last)
    if evaluated:
        assert datasets.eval is not None
        progress.eval_metrics = evaluate(strategy, state, datasets.eval, plan, heartbeat)
        progress.eval_step = progress.step
        hook.crosstrain_eval_end(
            context=context, step=progress.step, epoch=epoch, metrics=progress.eval_metrics
        )
        epoch_metrics.update({f"eval_{name}": value for name, value in progress.eval_metrics.items()})
    hook.crosstrain_epoch_end(context=context, epoch=epoch, metrics=epoch_metrics)
    every = plan.output.checkpoint_every_steps
    if every and (progress.step % every == 0 or (evaluated and plan.output.keep_best)):
        _save_resumable(strategy, state, context, progress, schedule, hook)
    _agree_stop(strategy, context, heartbeat)


def _epoch_steps(
    context: RunContext, datasets: Datasets, sampler: GlobalSampler, epoch: int, first_step: int
) -> Iterator[tuple[int, StepBatch]]:
    """This process's batches of the epoch's steps with their index in the epoch, from
    ``first_step`` (a resumed run skips the steps before its checkpoint) up to the run's
    last step."""
    plan, world = context.plan, context.world
    done_before = first_step - epoch * sampler.steps_per_epoch
    step = first_step
    train = epoch_rows(datasets.train, plan, epoch)  # token windows moved by the epoch's draws
    for index, (indices, weight) in enumerate(sampler.epoch(epoch)):
        if index < done_before:
            continue
        if step >= context.total_steps:
            return
        yield (
            index,
            step_batch(
                train,
                indices,
                weight,
                world.process_index,
                world.process_count,
                plan.train.grad_accum_steps,
                step=step,
                epoch=epoch,
            ),
        )
        step += 1


def _named_ahead(items: Iterator[_T], depth: int) -> Iterator[tuple[_T, list[_T]]]:
    """Each item with the items to name to the backend before it runs: first the item and
    the ``depth`` after it, then each time the one that comes within ``depth`` of it."""
    window = collections.deque(itertools.islice(items, depth + 1))
    named = list(window)
    while window:
        yield window[0], named
        window.popleft()
        named = list(itertools.islice(items, 1))
        window.extend(named)


@attrs.frozen
class _PendingStep:
    step: int
    epoch: int
    lr: float
    real_rows: int
    metrics: Mapping[str, Any]  # floats, or device scalars not read yet


class _StepLog:
    """Steps whose metrics are still on the device: read together every
    ``output.log_every_steps`` steps (one device sync for the chunk), then handed to the
    ``crosstrain_step_end`` hooks in order."""

    def __init__(
        self, strategy: DistributedStrategy, context: RunContext, hook: pluggy.HookRelay, progress: _Progress
    ) -> None:
        self.strategy, self.context, self.hook, self.progress = strategy, context, hook, progress
        self.pending: list[_PendingStep] = []
        self.loss_sum, self.real_rows = 0.0, 0

    def add(self, step: _PendingStep) -> bool:
        """Queue a step; True when that read (and logged) the chunk."""
        self.pending.append(step)
        if len(self.pending) >= self.context.plan.output.log_every_steps:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        """Read and log the pending steps. A non-finite loss under ``on_nonfinite = "stop"``
        is logged, then raises :class:`NonFiniteLoss` naming that step: the steps after it
        in the chunk already ran on the device, but are not logged and nothing after them
        is saved (a checkpoint always reads its steps first), so the run ends at that step."""
        pending, self.pending = self.pending, []
        values = resolve_metrics(self.strategy, [step.metrics for step in pending]) if pending else []
        stop = self.context.plan.train.on_nonfinite == "stop"
        for step, metrics in zip(pending, values, strict=True):
            finite = math.isfinite(metrics["loss"])
            if finite:
                self.loss_sum += metrics["loss"] * step.real_rows
                self.real_rows += step.real_rows
            else:
                self.progress.skipped_steps += 0 if stop else 1
            self.hook.crosstrain_step_end(
                context=self.context, step=step.step, epoch=step.epoch, lr=step.lr, metrics=metrics
            )
            if not finite and stop:
                raise NonFiniteLoss(step.step, metrics["loss"])
        self.progress.epoch_loss_sum, self.progress.epoch_real_rows = self.loss_sum, self.real_rows

    def flush_what_ran(self) -> None:
        """After a failure: log the steps that completed, if their values can still be read
        (nothing already written is lost); never mask the original error."""
        with contextlib.suppress(Exception):  # the device or a peer may be gone: the failure is reported
            self.flush()


def resolve_metrics(
    strategy: DistributedStrategy, pending: list[Mapping[str, Any]]
) -> list[dict[str, float]]:
    """Metric values as floats, through the backend's chunked read when it has one."""
    if isinstance(strategy, ResolvesMetrics):
        return strategy.resolve_metrics(pending)
    return [{name: float(value) for name, value in metrics.items()} for metrics in pending]


def _summary(context: RunContext, progress: _Progress, wall_seconds: float) -> dict[str, Any]:
    """The run's summary: what summary.json holds and fit() returns."""
    plan, world = context.plan, context.world
    return {
        "plan": plan.name,
        "backend": context.backend,
        "world_size": world.replicas,
        "processes": world.process_count,
        "device": world.device,
        "precision": plan.train.precision,
        "steps": progress.step,
        "epochs": progress.epochs_run,
        "train": {"loss": progress.last_train_loss},
        "eval": progress.eval_metrics,
        "samples_per_second": progress.train_samples / max(progress.train_seconds, 1e-9),
        "wall_seconds": wall_seconds,
        "resumed_from_step": progress.start_step or None,
        # why training ended before its last step (None: it ran them all)
        "stopped": progress.stopped,
        "skipped_nonfinite_steps": progress.skipped_steps,
    }


def _rank_reports(strategy: DistributedStrategy, state: Any, progress: _Progress) -> list[dict[str, Any]]:
    """summary.json's ``ranks``: every process's time split and memory (one all-reduce)."""
    mine: dict[str, float | None] = {
        "data_seconds": progress.data_seconds,
        "step_seconds": progress.step_seconds,
        "cpu_seconds": progress.cpu_seconds,
        "peak_host_memory_bytes": peak_host_memory_bytes(),
    }
    if isinstance(strategy, ReportsDevice):
        mine.update(strategy.device_report(state))
    world = strategy.world
    return gather_rank_reports(strategy.all_reduce, world.process_index, world.process_count, mine)


def _memory_per_rank(strategy: DistributedStrategy, state: Any) -> dict[str, int] | None:
    """summary.json's ``memory_per_rank``: the rank holding the most (one all-reduce); None
    where the backend does not count it."""
    if not isinstance(strategy, CountsMemory):
        return None
    world = strategy.world
    mine = strategy.memory_held(state)
    return largest_rank_memory(strategy.all_reduce, world.process_index, world.process_count, mine)


def _save_checkpoint(
    strategy: DistributedStrategy, state: Any, context: RunContext, step: int, hook: pluggy.HookRelay
) -> None:
    # state_dict may gather across ranks, so every rank calls it; only rank 0 writes.
    tensors = strategy.state_dict(state)
    path = context.out_dir / CHECKPOINT_FILE
    if context.world.is_main:
        metadata: Mapping[str, str] = {
            "backend": context.backend,
            "step": str(step),
            "plan": context.plan.name,
        }
        save_checkpoint(path, tensors, metadata)
    else:  # a sharded backend's tensors are gathered one by one as rank 0 writes them
        read_on_every_rank(tensors)
    strategy.barrier()
    hook.crosstrain_checkpoint_saved(context=context, path=str(path), step=step)
