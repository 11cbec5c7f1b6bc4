"""What the loop saves in a periodic checkpoint and restores from one, through the protocol.

The loop's position (step, epoch, the steps of the epoch already done, the epoch's running
loss) goes into :class:`~crosstrain.core.run.checkpoint.LoopState`; the tensors come from the
backend (weights through ``state_dict``, the optimizer through
:class:`~crosstrain.core.run.strategy.SavesOptimizerState`). Core makes the batches and the
learning rate from the step, so a resumed run takes exactly the uninterrupted run's path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from crosstrain.core.errors import BackendError, CheckpointError
from crosstrain.core.run.checkpoint import (
    Checkpoint,
    LoopState,
    best_checkpoint,
    check_written_by,
    plan_hash,
    prune,
    read_checkpoint,
    read_on_every_rank,
    resume_point,
    write_checkpoint,
)
from crosstrain.core.run.context import RunContext
from crosstrain.core.run.job import Job
from crosstrain.core.run.strategy import (
    DistributedStrategy,
    PlacesData,
    RestartsWorkers,
    SavesOptimizerState,
    SkipsNonFiniteSteps,
)
from crosstrain.core.spec.plan import Plan


@attrs.define
class Position:
    """Where the loop stands; what a checkpoint records beside the tensors."""

    step: int = 0
    epoch_loss_sum: float = 0.0  # the current epoch's steps so far (its mean loss when resumed)
    epoch_real_rows: int = 0
    eval_metrics: dict[str, float] = attrs.field(factory=dict)
    eval_step: int | None = None
    checkpointed_step: int | None = None  # the step of the newest checkpoint written


def check_backend_supports(
    strategy: DistributedStrategy, plan: Plan, backend: str, max_restarts: int = 0
) -> None:
    """Refuse, before launch, what the job asks of a backend that lacks the capability."""
    if max_restarts > 0 and not (isinstance(strategy, RestartsWorkers) and strategy.restarts_workers()):
        raise BackendError(f"--max-restarts: the {backend} backend cannot restart its workers")
    if plan.output.checkpoint_every_steps is not None and not isinstance(strategy, SavesOptimizerState):
        raise BackendError(
            f"output.checkpoint_every_steps: the {backend} backend cannot save its optimizer's "
            f"state (it does not implement SavesOptimizerState), so it cannot write resumable checkpoints"
        )
    if plan.data.placement == "device" and not isinstance(strategy, PlacesData):
        # on a GPU the rows would silently stay on the host: say so instead
        raise BackendError(
            f"data.placement = 'device': the {backend} backend keeps the data on the host "
            f"(it does not implement PlacesData); use 'auto' or 'host'"
        )
    if plan.train.on_nonfinite == "skip" and not (
        isinstance(strategy, SkipsNonFiniteSteps) and strategy.skips_nonfinite_steps()
    ):
        raise BackendError(f"train.on_nonfinite = 'skip': the {backend} backend cannot skip a step's update")


def find_resume_point(job: Job) -> Checkpoint | None:
    """The checkpoint a resuming job continues from (None: start from step 0): the one the
    admission step chose (``job.resume_from``, so every worker reads the checkpoint that was
    verified and named before launch), else the run folder's newest intact one (a group
    restarted after a failure continues from the newest checkpoint it wrote itself)."""
    if job.resume_from is not None:
        path = Path(job.resume_from)
        check_written_by(path, job.plan)
        return read_checkpoint(path)
    return resume_point(Path(job.out_dir), job.plan) if job.launch.resume else None


def restore(strategy: DistributedStrategy, state: Any, checkpoint: Checkpoint, position: Position) -> None:
    """Load the checkpoint's weights and optimizer state; move ``position`` to its step."""
    if not isinstance(strategy, SavesOptimizerState):
        raise BackendError(f"the {strategy.name} backend cannot load an optimizer's state to resume")
    strategy.load_state_dict(state, checkpoint.weights)
    strategy.load_optimizer_state(state, checkpoint.optimizer)
    saved = checkpoint.state
    position.step = saved.step
    position.epoch_loss_sum, position.epoch_real_rows = saved.epoch_loss_sum, saved.epoch_real_rows
    position.eval_metrics, position.eval_step = dict(saved.eval), saved.eval_step
    position.checkpointed_step = saved.step


def restore_best(strategy: DistributedStrategy, state: Any, context: RunContext, position: Position) -> int:
    """Load the weights of the checkpoint ``output.keep_best`` kept (its eval metrics become
    the run's); return its step."""
    keep_best = context.plan.output.keep_best
    best = best_checkpoint(context.out_dir, keep_best) if keep_best else None
    if best is None:
        raise CheckpointError(f"no checkpoint of the best {keep_best} in {context.out_dir} to restore")
    checkpoint = read_checkpoint(best)
    strategy.load_state_dict(state, checkpoint.weights)
    position.eval_metrics, position.eval_step = dict(checkpoint.state.eval), checkpoint.state.eval_step
    return checkpoint.state.step


def save(
    strategy: DistributedStrategy, state: Any, context: RunContext, position: Position, lr: float
) -> str:
    """Write ``checkpoints/step-NNNNNNNN`` (rank 0; every rank gathers), prune; return its path."""
    assert isinstance(strategy, SavesOptimizerState)  # check_backend_supports refused it before launch
    # both may gather across ranks, so every rank calls them (and reads a streamed
    # backend's tensors, which gather as they are read); only rank 0 writes
    weights = strategy.state_dict(state)
    optimizer = strategy.optimizer_state(state)
    plan, per_epoch = context.plan, max(context.steps_per_epoch, 1)
    loop_state = LoopState(
        step=position.step,
        epoch=position.step // per_epoch,
        step_in_epoch=position.step % per_epoch,
        backend=context.backend,
        plan_hash=plan_hash(plan),
        plan=plan.name,
        epoch_loss_sum=position.epoch_loss_sum if position.step % per_epoch else 0.0,
        epoch_real_rows=position.epoch_real_rows if position.step % per_epoch else 0,
        eval=dict(position.eval_metrics),
        eval_step=position.eval_step,
        next_lr=lr,
        optimizer={"name": plan.optimizer.name},
        rng={"seed": plan.seed, "dropout_step": position.step},
    )
    path = context.out_dir / "checkpoints" / f"step-{position.step:08d}"
    if context.world.is_main:
        path = write_checkpoint(context.out_dir, loop_state, weights, optimizer)
        prune(context.out_dir, plan.output.keep_checkpoints, plan.output.keep_best)
    else:  # a sharded backend's tensors are gathered one by one as rank 0 writes them
        read_on_every_rank(weights)
        read_on_every_rank(optimizer)
    strategy.barrier()  # no rank runs ahead of (or resumes before) a checkpoint being complete
    position.checkpointed_step = position.step
    return str(path)
