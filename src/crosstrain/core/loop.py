"""fit() and evaluate(): the one training loop, written against the protocol only.

Core owns the weights' first values, the batches and the learning rate; the
backend owns the native model and the collectives. Nothing here knows which
backend runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import pluggy

from crosstrain.core.checkpoint import save_checkpoint
from crosstrain.core.context import RunContext
from crosstrain.core.data import (
    ArrayDataset,
    Datasets,
    GlobalSampler,
    StepBatch,
    eval_batches,
    load_datasets,
    shard,
    step_batch,
)
from crosstrain.core.heartbeat import Heartbeat
from crosstrain.core.plan import Plan
from crosstrain.core.report import gather_rank_reports, peak_host_memory_bytes
from crosstrain.core.schedule import LearningRateSchedule
from crosstrain.core.strategy import (
    DistributedStrategy,
    Job,
    PlacesData,
    PrefetchesBatches,
    ReportsDevice,
    ResolvesMetrics,
)

CHECKPOINT_FILE = "model.safetensors"


def total_steps(plan: Plan, train_rows: int) -> int:
    """Optimizer steps in the run: epochs x steps per epoch, capped by max_steps."""
    per_epoch = GlobalSampler(train_rows, plan.train.global_batch_size, plan.seed).steps_per_epoch
    steps = plan.train.epochs * per_epoch
    return min(steps, plan.train.max_steps) if plan.train.max_steps else steps


def initial_weights(plan: Plan) -> dict[str, np.ndarray]:
    """DESIGN rule 2: the same numpy weights for every backend (none for a native model)."""
    if plan.model.native is not None:
        return {}
    return plan.model.graph().init_weights(plan.seed)


def fit(strategy: DistributedStrategy, job: Job, hook: pluggy.HookRelay) -> dict[str, Any]:
    """Train the job's plan on this process's share of the world; return the summary."""
    summary, _ = train(strategy, job, hook)
    return summary


@attrs.define
class _Progress:
    """What the loop has done so far, for the epoch lines and the summary."""

    step: int = 0
    epochs_run: int = 0
    train_seconds: float = 0.0
    train_samples: int = 0
    last_train_loss: float = float("nan")
    eval_metrics: dict[str, float] = attrs.field(factory=dict)
    data_seconds: float = 0.0  # building batches on the host: the device may wait on this
    step_seconds: float = 0.0  # handing steps to the backend and reading their losses

    def add_data_time(self, since: float) -> float:
        now = time.perf_counter()
        self.data_seconds += now - since
        return now

    def add_step_time(self, since: float) -> float:
        now = time.perf_counter()
        self.step_seconds += now - since
        return now


def train(strategy: DistributedStrategy, job: Job, hook: pluggy.HookRelay) -> tuple[dict[str, Any], Any]:
    """fit(), also returning the backend's trained state (for tests and embedding code)."""
    started = time.perf_counter()
    plan, world = job.plan, strategy.world
    datasets = load_datasets(plan)
    sampler = GlobalSampler(len(datasets.train), plan.train.global_batch_size, plan.seed, plan.data.shuffle)
    context = RunContext(
        job=job,
        world=world,
        total_steps=total_steps(plan, len(datasets.train)),
        steps_per_epoch=sampler.steps_per_epoch,
        train_rows=len(datasets.train),
        eval_rows=len(datasets.eval) if datasets.eval else 0,
    )
    heartbeat = Heartbeat(world.process_index)  # a launcher watching names a rank that stops
    try:
        state = strategy.build(plan, initial_weights(plan))
        if isinstance(strategy, PlacesData):
            strategy.place_data(state, datasets)
        hook.crosstrain_train_start(context=context)
        progress = _Progress()
        schedule = LearningRateSchedule(plan.optimizer.lr, plan.schedule, context.total_steps)
        for epoch in range(plan.train.epochs):
            if progress.step >= context.total_steps:
                break
            _train_epoch(
                strategy, state, context, datasets, sampler, schedule, epoch, progress, hook, heartbeat
            )
        if plan.output.checkpoint:
            _save_checkpoint(strategy, state, context, progress.step, hook)
        summary = _summary(context, progress, time.perf_counter() - started)
        summary["ranks"] = _rank_reports(strategy, state, progress)
        hook.crosstrain_train_end(context=context, summary=summary)
    except BaseException as error:
        report_exception(hook, context, error)
        raise
    finally:
        heartbeat.close()
    return summary, state


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
    epoch_started = time.perf_counter()
    log = _StepLog(strategy, context, hook)
    clock = time.perf_counter()
    try:
        for batch, upcoming in _with_next(_epoch_steps(context, datasets, sampler, epoch, progress.step)):
            if upcoming is not None and isinstance(strategy, PrefetchesBatches):
                strategy.prefetch(state, upcoming)
            lr = schedule(progress.step)
            clock = progress.add_data_time(clock)
            heartbeat.beat("step")
            metrics = strategy.train_step(state, batch, lr)
            progress.step += 1
            heartbeat.beat("idle", progress.step)
            log.add(_PendingStep(progress.step, epoch, lr, batch.global_real_rows, metrics))
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
    progress.train_samples += real_rows
    progress.last_train_loss = loss_sum / max(real_rows, 1)
    epoch_metrics = {
        "loss": progress.last_train_loss,
        "samples_per_second": real_rows / max(epoch_seconds, 1e-9),
    }
    is_last = progress.step >= context.total_steps or epoch + 1 == plan.train.epochs
    if datasets.eval is not None and ((epoch + 1) % plan.train.eval_every_epochs == 0 or is_last):
        progress.eval_metrics = evaluate(strategy, state, datasets.eval, plan, heartbeat)
        hook.crosstrain_eval_end(
            context=context, step=progress.step, epoch=epoch, metrics=progress.eval_metrics
        )
        epoch_metrics.update({f"eval_{name}": value for name, value in progress.eval_metrics.items()})
    hook.crosstrain_epoch_end(context=context, epoch=epoch, metrics=epoch_metrics)


def _epoch_steps(
    context: RunContext, datasets: Datasets, sampler: GlobalSampler, epoch: int, first_step: int
) -> Iterator[StepBatch]:
    """This process's batches of the epoch's steps, numbered from ``first_step``, up to the
    run's last step."""
    plan, world = context.plan, context.world
    step = first_step
    for indices, weight in sampler.epoch(epoch):
        if step >= context.total_steps:
            return
        yield step_batch(
            datasets.train,
            indices,
            weight,
            world.process_index,
            world.process_count,
            plan.train.grad_accum_steps,
            step=step,
        )
        step += 1


def _with_next(steps: Iterator[StepBatch]) -> Iterator[tuple[StepBatch, StepBatch | None]]:
    """Each step with the one after it (None for the last), so its rows can be prefetched."""
    current = next(steps, None)
    while current is not None:
        upcoming = next(steps, None)
        yield current, upcoming
        current = upcoming


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

    def __init__(self, strategy: DistributedStrategy, context: RunContext, hook: pluggy.HookRelay) -> None:
        self.strategy, self.context, self.hook = strategy, context, hook
        self.pending: list[_PendingStep] = []
        self.loss_sum, self.real_rows = 0.0, 0

    def add(self, step: _PendingStep) -> None:
        self.pending.append(step)
        if len(self.pending) >= self.context.plan.output.log_every_steps:
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        values = resolve_metrics(self.strategy, [step.metrics for step in pending])
        for step, metrics in zip(pending, values, strict=True):
            self.loss_sum += metrics["loss"] * step.real_rows
            self.real_rows += step.real_rows
            self.hook.crosstrain_step_end(
                context=self.context, step=step.step, epoch=step.epoch, lr=step.lr, metrics=metrics
            )

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
    }


def _rank_reports(strategy: DistributedStrategy, state: Any, progress: _Progress) -> list[dict[str, Any]]:
    """summary.json's ``ranks``: every process's time split and memory (one all-reduce)."""
    mine: dict[str, float | None] = {
        "data_seconds": progress.data_seconds,
        "step_seconds": progress.step_seconds,
        "peak_host_memory_bytes": peak_host_memory_bytes(),
    }
    if isinstance(strategy, ReportsDevice):
        mine.update(strategy.device_report(state))
    world = strategy.world
    return gather_rank_reports(strategy.all_reduce, world.process_index, world.process_count, mine)


def evaluate(
    strategy: DistributedStrategy,
    state: Any,
    dataset: ArrayDataset,
    plan: Plan,
    heartbeat: Heartbeat | None = None,
) -> dict[str, float]:
    """Exact metrics over the whole eval set: sums of real rows only, divided once at the end,
    so world N equals world 1 whatever the padding."""
    world = strategy.world
    totals: dict[str, float] = {}
    for indices, weight in eval_batches(dataset, plan.train.global_batch_size):
        batch = shard(dataset, indices, weight, world.process_index, world.process_count)
        if heartbeat is not None:
            heartbeat.beat("eval")
        for name, value in strategy.eval_step(state, batch).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    if heartbeat is not None:
        heartbeat.beat("idle")
    count = totals.get("count", 0.0)
    metrics = {"loss": totals.get("loss_sum", 0.0) / max(count, 1.0), "count": count}
    if "accuracy" in plan.metrics:
        metrics["accuracy"] = totals.get("correct", 0.0) / max(count, 1.0)
    return metrics


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
    strategy.barrier()
    hook.crosstrain_checkpoint_saved(context=context, path=str(path), step=step)
