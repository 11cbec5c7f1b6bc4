"""What a TorchStrategy runs on its device: one optimizer step (its kernels launched one by
one, or replayed as one CUDA graph), the evaluation sums and the predictions; and what they
share (the forward, autocast, the update). The torch side of backends/tf/steps.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from crosstrain.backends.torch.graphs import StepGraph
from crosstrain.backends.torch.model import METRIC_COUNTS, per_row_loss, summed_loss
from crosstrain.backends.torch.optimizer import grads_finite
from crosstrain.backends.torch.state import PRECISIONS, TorchState
from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.spec.plan import CLASS_LOSSES


@attrs.frozen
class DeviceMean:
    """A step's metric still on the device: a sum and the count that divides it, in float64
    once read (:meth:`TorchStrategy.resolve_metrics` reads a chunk of them at once)."""

    total: torch.Tensor
    count: int

    def __float__(self) -> float:
        return float(self.total.double()) / self.count


def train_step(state: TorchState, step: StepBatch, lr: float) -> dict[str, Any]:
    """One optimizer step over the step's micro-batches; its loss stays on the device."""
    state.set_training(True)
    # the loss is the sum over real targets / the global real targets. DDP averages gradients
    # over processes, so multiply by the process count to turn that average into a sum.
    scale = state.processes / step.global_real_targets
    if state.step_graph is not None:
        return _graphed_step(state, state.step_graph, step, lr, scale)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    if state.cuda_graphs:  # a new iteration: the last one's graph outputs may be overwritten
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
    loss_sum = None
    last = len(step.micro_batches) - 1
    for index, micro in enumerate(step.micro_batches):
        x, y, weight, rows = state.feed.tensors(micro)
        with _no_sync(state, skip=index < last):
            # without padding the mask is all ones: the same sum, fewer kernels
            mask = None if micro.weight.all() else weight
            micro_sum = _micro_loss(state, x, y, weight, rows, step.step, mask)
            if state.scaler is not None:
                state.scaler.scale(micro_sum * scale).backward()  # type: ignore[no-untyped-call]
            else:  # backward from d(loss)/d(sum) = scale: no multiply, no seed of ones
                micro_sum.backward(state.gradient_seed(scale, micro_sum))  # type: ignore[no-untyped-call]
        if state.cuda_graphs:  # a compiled graph's output: the next step's replay overwrites it
            micro_sum = micro_sum.detach().clone()
        loss_sum = _add_loss(loss_sum, micro_sum)
    if _skip_nonfinite(state):
        state.optimizer.zero_grad(set_to_none=True)
    else:
        apply_update(state)
        state.optimizer.zero_grad(set_to_none=True)
        state.optimizer_steps += 1
    assert loss_sum is not None  # a step has at least one micro-batch
    # stays on the device: NCCL's all-reduce does not block the host, and the loop reads
    # a chunk of steps at once (resolve_metrics), dividing there: no kernel a step for it
    return {"loss": DeviceMean(sum_across(state, loss_sum), step.global_real_targets)}


def _micro_loss(
    state: TorchState,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    step: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """A micro-batch's summed loss: the compiled forward and loss where train.compile made
    them one module (:class:`CompiledLoss`), else the forward under autocast, then the loss."""
    if state.compiled_loss is not None:
        return state.compiled_loss(x, y, rows, step, mask)
    with autocast(state):
        outputs = forward(state, state.model, x, weight, rows, step)
    return summed_loss(state.plan.loss, outputs, y, mask)


class CompiledLoss(torch.nn.Module):
    """One process's forward and loss as one module, which ``train.compile`` compiles whole:
    compiled apart, the model hands its logits to an eager loss, which widens them to
    float32, and computes and differentiates the softmax in kernels of its own. At GPT-2's
    vocabulary that is 50,304 logits a position, 3.3 GB of float32 a step at batch 16 x
    1024 written and read several times; compiled with the model, the cast, the softmax and
    its gradient fuse into the few kernels that read the bf16 logits (nanoGPT compiles its
    loss with its model the same way). The step is what :func:`_micro_loss` computes eagerly:
    the float rows in the weights' dtype, the forward under the plan's autocast, the loss.

    The model is told when every row is real (``mask`` None), so batch norm is then torch's
    own, which inductor fuses with its neighbours (the masked form a padded batch needs does
    not fuse: docs/performance.md has what it cost ResNet-50). The launched and replayed
    steps keep the masked form for every batch: a run launched and one replayed as a CUDA
    graph stay alike step for step."""

    def __init__(self, state: TorchState) -> None:
        super().__init__()
        self.model = state.model
        self.loss = state.plan.loss
        self.native = state.plan.model.native is not None
        self.dtype = state.dtype
        self.device_type = torch.device(state.device).type
        name = PRECISIONS[state.plan.train.precision]
        # a dtype torch.autocast accepts even when disabled (fp32, fp64: no autocast)
        self.autocast_dtype = getattr(torch, name) if name else torch.bfloat16
        self.autocast = name is not None

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: torch.Tensor,
        step: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != self.dtype:
            x = x.to(self.dtype)
        with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast):
            outputs = self.model(x) if self.native else self.model(x, mask, rows, step, False)
        return summed_loss(self.loss, outputs, y, mask)


def _graphed_step(
    state: TorchState, graph: StepGraph, step: StepBatch, lr: float, scale: float
) -> dict[str, Any]:
    """The step replayed as one CUDA graph (its first steps warm it up)."""
    if graph.captures_next:
        state.feed.settle()
    micro_batches = [state.feed.graph_sources(micro) for micro in step.micro_batches]
    update = functools.partial(_update, state, graph)
    loss_sum = graph.run(update, micro_batches, lr, scale, step.step)
    state.optimizer_steps += 1  # here: a replay runs no Python
    return {"loss": DeviceMean(loss_sum, step.global_real_targets)}


def _update(
    state: TorchState,
    graph: StepGraph,
    micro_batches: Sequence[tuple[torch.Tensor, ...]],
    counter: torch.Tensor,
) -> torch.Tensor:
    """Forward and backward of each micro-batch's (x, y, row mask, row positions), then
    the optimizer's update, every value on the device (what a CUDA graph captures): the
    gradients' seed, the learning rate and the step counter dropout reads are the
    graph's tensors; the row mask weighs every step's loss (a padded batch replays the
    same graph). The gradients are dropped first: the capture then makes its own, which
    every replay writes afresh, and the micro-batches add to."""
    state.optimizer.zero_grad(set_to_none=True)
    loss_sum = None
    for x, y, weight, rows in micro_batches:
        with autocast(state, cache=False):  # a capture must not keep cached casts
            outputs = forward(state, state.model, x, weight, rows, counter)
        micro_sum = summed_loss(state.plan.loss, outputs, y, weight)
        micro_sum.backward(graph.seed)  # type: ignore[no-untyped-call]
        loss_sum = _add_loss(loss_sum, micro_sum)
    assert loss_sum is not None  # a step has at least one micro-batch
    apply_update(state)
    counter.add_(1)
    return loss_sum


def resolve_metrics(pending: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """A chunk of steps' metrics, read with one device-to-host copy."""
    names = list(pending[0])
    values = [metrics[name] for metrics in pending for name in names]
    totals = [value.total if isinstance(value, DeviceMean) else torch.as_tensor(value) for value in values]
    if len({(total.dtype, total.device) for total in totals}) > 1:
        totals = [total.double().cpu() for total in totals]
    read = torch.stack(totals).double().tolist()
    means = [
        total / value.count if isinstance(value, DeviceMean) else total
        for total, value in zip(read, values, strict=True)
    ]
    return [
        dict(zip(names, means[row * len(names) : (row + 1) * len(names)], strict=True))
        for row in range(len(pending))
    ]


def eval_step(state: TorchState, batch: Batch) -> dict[str, float]:
    """The batch's weighted loss sum, its hits of each counted metric (classification) and
    its target count, summed over the processes."""
    state.set_training(False)
    plan = state.plan
    x, y, weight, rows = state.feed.tensors(batch)
    with torch.no_grad(), autocast(state):
        # the module, not DDP: no gradient sync is needed
        outputs = forward(state, state.module, x, weight, rows, 0)
    with torch.no_grad():
        weight64 = weight.double()
        positions = y[0].numel() if plan.loss.name in CLASS_LOSSES else 1  # target positions per row
        names = ["loss_sum"]
        sums = [(per_row_loss(plan.loss, outputs, y).double() * weight64).sum()]
        for metric in plan.metrics:
            if metric in METRIC_COUNTS:
                name, hits = METRIC_COUNTS[metric]
                names.append(name)
                sums.append((hits(outputs, y, plan).double() * weight64).sum())
        names.append("count")
        sums.append(weight64.sum() * positions)
        totals = sum_across(state, torch.stack(sums)).tolist()
    return dict(zip(names, totals, strict=True))


def predict(state: TorchState, x: np.ndarray) -> np.ndarray:
    state.set_training(False)
    inputs = torch.from_numpy(np.ascontiguousarray(x)).to(state.device)
    with torch.no_grad(), autocast(state):
        outputs = forward(state, state.module, inputs, None, None, 0)
    return np.asarray(outputs.float().cpu().numpy())


def forward(
    state: TorchState, model: Any, x: Any, weight: Any, rows: Any, step: int | torch.Tensor
) -> torch.Tensor:
    """A native model sees the inputs only; the neutral graph also gets what batch norm
    (the row mask) and dropout (rows, step) need. Float rows reach the model in its weights'
    dtype: fp64 widens the float32 rows the feed gives (exactly) to float64 here, once."""
    if x.is_floating_point() and x.dtype != state.dtype:
        x = x.to(state.dtype)
    if state.plan.model.native is not None:
        return model(x)  # type: ignore[no-any-return]
    return model(x, weight, rows, step, state.distributed)  # type: ignore[no-any-return]


def apply_update(state: TorchState) -> None:
    """Clip the gradients (unscaled first under fp16) and step the optimizer (through
    fp16's scaler, which skips a step whose gradients overflowed)."""
    if state.scaler is None:
        clip_gradients(state)
        state.optimizer.step()
        return
    if state.plan.train.clip_grad_norm is not None:
        state.scaler.unscale_(state.optimizer)
        clip_gradients(state)
    state.scaler.step(state.optimizer)
    state.scaler.update()


def clip_gradients(state: TorchState) -> None:
    """Clip to the global norm: sharded gradients are DTensors, whose norm torch computes
    over every rank's shards (the unsharded norm, summed in another order)."""
    clip = state.plan.train.clip_grad_norm
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(state.module.parameters(), clip)


def autocast(state: TorchState, cache: bool = True) -> contextlib.AbstractContextManager[Any]:
    """The plan's mixed precision on the state's device (fp32 and fp64: nothing)."""
    name = PRECISIONS[state.plan.train.precision]
    if name is None:
        return contextlib.nullcontext()
    dtype = getattr(torch, name)
    return torch.autocast(device_type=torch.device(state.device).type, dtype=dtype, cache_enabled=cache)


def sum_across(state: TorchState, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the processes, in float64 as every backend sums."""
    if state.distributed:
        tensor = tensor.double()  # a new tensor: the caller's stays as it was
        dist.all_reduce(tensor)
    return tensor


def _add_loss(loss_sum: torch.Tensor | None, micro_sum: torch.Tensor) -> torch.Tensor:
    """A step's summed loss so far plus a micro-batch's, off the autograd graph: several
    micro-batches add up in float64 (one alone is widened when it is read), launched or
    replayed alike."""
    micro_sum = micro_sum.detach()
    return micro_sum if loss_sum is None else loss_sum.double() + micro_sum.double()


def _skip_nonfinite(state: TorchState) -> bool:
    """``on_nonfinite = "skip"``: a step whose summed gradients are not finite applies no
    update (one host read per step, in this mode only; fp16's GradScaler skips on its own)."""
    if state.plan.train.on_nonfinite != "skip" or state.scaler is not None:
        return False
    return not grads_finite(state.module.parameters(), sharded=state.sharded)


def _no_sync(state: TorchState, skip: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip DDP's all-reduce (FSDP2's reduce-scatter) on every accumulation micro-step but
    the last: the micro-steps' gradients add up unreduced, and the last one reduces the sum."""
    if state.sharded:
        # FSDP2 has no context for it: a flag, which the last micro-step turns back on
        state.model.set_requires_gradient_sync(not skip)  # type: ignore[operator]
        return contextlib.nullcontext()
    if skip and state.distributed:
        return state.model.no_sync()  # type: ignore[operator,no-any-return]
    return contextlib.nullcontext()
