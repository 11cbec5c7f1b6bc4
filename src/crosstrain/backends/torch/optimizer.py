"""The optimizer of the torch backend: torch.optim, whose semantics a plan's optimizer means."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from crosstrain.backends.torch.sharding import is_sharded, local, local_optimizer
from crosstrain.core.run.checkpoint import StreamedTensors
from crosstrain.core.spec.plan import OptimizerSpec

if TYPE_CHECKING:
    from crosstrain.backends.torch.zero import ShardedStateOptimizer

Params = list[torch.nn.Parameter]
#: (parameters, the plan's optimizer, fused, capturable) -> torch.optim's keyword arguments
Arguments = Callable[[Params, OptimizerSpec, bool, bool], dict[str, Any]]


@attrs.frozen
class TorchOptimizer:
    """How one core optimizer runs on torch: torch.optim's class, its arguments from the
    plan's optimizer, its state keys under core's slot names
    (:data:`crosstrain.core.model.optimizers.OPTIMIZER_SLOTS`), whether it keeps its own step
    count (Adam's bias corrections read it), and whether its fused kernel may run under
    fp16's loss scaler."""

    kind: type[torch.optim.Optimizer]
    arguments: Arguments
    #: torch.optim's state key -> core's slot name
    slots: Mapping[str, str]
    counts_steps: bool = False
    fused_under_loss_scaling: bool = True


def _sgd(params: Params, spec: OptimizerSpec, fused: bool, capturable: bool) -> dict[str, Any]:
    # captured: the fused kernel, which reads a tensor learning rate on the device (torch's
    # foreach and for-loop SGD read it on the host, and SGD has no ``capturable`` flag)
    return {
        "lr": _learning_rate(params, spec, capturable),
        "momentum": spec.momentum,
        "nesterov": spec.nesterov,
        "weight_decay": spec.weight_decay,
        "fused": fused or capturable or None,
    }


def _adam(params: Params, spec: OptimizerSpec, fused: bool, capturable: bool) -> dict[str, Any]:
    """torch's Adam and AdamW take the same arguments (AdamW decays the weights apart from
    the gradient)."""
    return {
        "lr": _learning_rate(params, spec, capturable),
        "betas": (spec.beta1, spec.beta2),
        "eps": spec.eps,
        "weight_decay": spec.weight_decay,
        "fused": fused or None,
        "capturable": capturable,
    }


def _learning_rate(params: Params, spec: OptimizerSpec, capturable: bool) -> float | torch.Tensor:
    """The plan's learning rate; on the parameters' device when the update is captured in a
    CUDA graph (the replays read it there, and the host writes it as the schedule moves)."""
    if not capturable:
        return spec.lr
    return torch.tensor(spec.lr, dtype=torch.float32, device=params[0].device)


_ADAM_SLOTS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

#: core optimizer name -> how torch runs it (``fused``: one kernel for every parameter;
#: ``capturable``: the update reads its learning rate and step count from the device).
#: SGD's fused kernel is kept away from fp16's loss scaler: torch's fused SGD makes its
#: momentum buffers with empty_like at its first step and fills them in the kernel, so a
#: first step the scaler skips (an overflow, which its first scales often cause) leaves
#: them unwritten, and every later update adds whatever memory held (docs/gpu.md#precision).
#: Fused Adam and AdamW leave their state alone on a skipped step.
OPTIMIZERS: dict[str, TorchOptimizer] = {
    "sgd": TorchOptimizer(
        torch.optim.SGD, _sgd, {"momentum_buffer": "momentum"}, fused_under_loss_scaling=False
    ),
    "adam": TorchOptimizer(torch.optim.Adam, _adam, _ADAM_SLOTS, counts_steps=True),
    "adamw": TorchOptimizer(torch.optim.AdamW, _adam, _ADAM_SLOTS, counts_steps=True),
}


def make_optimizer(
    module: torch.nn.Module,
    spec: OptimizerSpec,
    fused: bool = False,
    capturable: bool = False,
    loss_scaled: bool = False,
    undecayed: Collection[torch.nn.Parameter] = (),
    sharded_state: bool = False,
) -> torch.optim.Optimizer:
    """The plan's optimizer over the trainable parameters (batch norm's running statistics
    are buffers, never optimized); ``fused`` on CUDA under ``train.compile`` or a CUDA
    graph, ``capturable`` under a CUDA graph; ``loss_scaled``: fp16's scaler steps it.
    ``undecayed`` (``optimizer.decay``): parameters in a group of their own without weight
    decay; the groups share every other setting, the learning rate tensor included.
    ``sharded_state`` (``train.shard = "optimizer"`` over several processes): the same
    optimizer, its state split over the ranks (ZeRO-1, backends/torch/zero.py)."""
    row = OPTIMIZERS[spec.name]
    if loss_scaled and not row.fused_under_loss_scaling:
        fused = False
    params = list(module.parameters())
    arguments = row.arguments(params, spec, fused, capturable)
    skipped = {id(param) for param in undecayed}
    decayed = [param for param in params if id(param) not in skipped]
    undecayed_group = [param for param in params if id(param) in skipped]
    groups: list[dict[str, Any]] = [{"params": decayed}] if decayed else []
    if undecayed_group:
        groups.append({"params": undecayed_group, "weight_decay": 0.0})
    if sharded_state:
        from crosstrain.backends.torch.zero import ShardedStateOptimizer

        return ShardedStateOptimizer(row.kind, groups, arguments)
    return row.kind(groups, **arguments)


def _row_of(optimizer: torch.optim.Optimizer) -> TorchOptimizer:
    """The row that built ``optimizer``."""
    return next(row for row in OPTIMIZERS.values() if type(optimizer) is row.kind)


Layouts = Mapping[str, tuple[torch.nn.Parameter, tuple[int, ...] | None]]


def neutral_optimizer_state(
    optimizer: torch.optim.Optimizer,
    parameters: Layouts,
    counted_steps: int,
    scalars: Mapping[str, np.ndarray] | None = None,
) -> Mapping[str, np.ndarray]:
    """Slots as ``optimizer.{weight}.{slot}`` in the weights' neutral layouts, and
    ``optimizer.step``: Adam's own count when it keeps one, else the steps counted here;
    then ``scalars`` (the loss scale's). Sharded slots are streamed: each gathered whole only
    when it is read (every rank reads them, in order; the scalars gather nothing)."""
    from crosstrain.backends.torch.model import neutral_shape, to_neutral
    from crosstrain.backends.torch.zero import ShardedStateOptimizer

    if isinstance(optimizer, ShardedStateOptimizer):
        return _owned_optimizer_state(optimizer, parameters, counted_steps, scalars)
    slots = _row_of(optimizer).slots
    found: dict[str, tuple[torch.Tensor, tuple[int, ...] | None]] = {}
    steps: list[int] = []
    for neutral, (param, axes) in parameters.items():
        saved = optimizer.state.get(param, {})
        for native, slot in slots.items():
            if saved.get(native) is not None:
                found[f"optimizer.{neutral}.{slot}"] = (saved[native], axes)
        if "step" in saved:
            steps.append(int(float(saved["step"])))
    counts = {"optimizer.step": np.asarray(max(steps, default=counted_steps), np.int64), **(scalars or {})}
    if not any(is_sharded(tensor) for tensor, _ in found.values()):
        return {**{name: to_neutral(tensor, axes) for name, (tensor, axes) in found.items()}, **counts}

    def read(name: str) -> np.ndarray:
        if name in counts:
            return counts[name]
        tensor, axes = found[name]
        return to_neutral(tensor, axes)

    specs = {
        name: (neutral_shape(tensor.shape, axes), _numpy_dtype(tensor.dtype))
        for name, (tensor, axes) in found.items()
    }
    specs.update((name, (value.shape, value.dtype)) for name, value in counts.items())
    return StreamedTensors(specs, read)


def _owned_optimizer_state(
    optimizer: ShardedStateOptimizer,
    parameters: Layouts,
    counted_steps: int,
    scalars: Mapping[str, np.ndarray] | None,
) -> StreamedTensors:
    """:func:`neutral_optimizer_state` of a ZeRO-1 optimizer: each slot's pieces live on the
    ranks that update them. The ranks first agree which slots exist and the step count (one
    all-reduce); then each slot is gathered from its pieces' owners when it is read, so no
    rank holds more than one whole slot beyond its own pieces."""
    import torch.distributed as dist

    from crosstrain.backends.torch.model import neutral_shape, to_neutral

    slots = _row_of(optimizer.local).slots
    keys = [(neutral, native, slot) for neutral in parameters for native, slot in slots.items()]
    # one flag per slot (kept by its owners), then the largest step count (-1: none kept)
    held = torch.tensor(
        [int(optimizer.holds(parameters[neutral][0], native)) for neutral, native, _ in keys]
        + [max(optimizer.steps_counted(), default=-1)],
        dtype=torch.int64,
        device=next(iter(parameters.values()))[0].device,
    )
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    flags = held.tolist()
    found = {
        f"optimizer.{neutral}.{slot}": (neutral, native)
        for (neutral, native, slot), flag in zip(keys, flags, strict=False)
        if flag
    }
    counts = {
        "optimizer.step": np.asarray(flags[-1] if flags[-1] >= 0 else counted_steps, np.int64),
        **(scalars or {}),
    }

    def read(name: str) -> np.ndarray:
        if name in counts:
            return counts[name]
        neutral, native = found[name]
        param, axes = parameters[neutral]
        return to_neutral(optimizer.gathered(param, native), axes)

    specs = {
        name: (neutral_shape(parameters[neutral][0].shape, parameters[neutral][1]),
               _numpy_dtype(parameters[neutral][0].dtype))
        for name, (neutral, _) in found.items()
    }  # fmt: skip
    specs.update((name, (value.shape, value.dtype)) for name, value in counts.items())
    return StreamedTensors(specs, read)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype :func:`~crosstrain.backends.torch.model.to_neutral` gives a slot of
    ``dtype``: float32, or float64 for a float64 one."""
    return np.dtype(str(torch.promote_types(dtype, torch.float32)).removeprefix("torch."))


def load_neutral_optimizer_state(
    optimizer: torch.optim.Optimizer, parameters: Layouts, tensors: Mapping[str, np.ndarray]
) -> int:
    """Set torch.optim's state from neutral slots; return the optimizer step count. A ZeRO-1
    optimizer keeps the slots of the parameters this rank updates only."""
    from crosstrain.backends.torch.model import from_neutral
    from crosstrain.backends.torch.zero import ShardedStateOptimizer

    sharded = optimizer if isinstance(optimizer, ShardedStateOptimizer) else None
    optimizer = local_optimizer(optimizer)
    row = _row_of(optimizer)
    step = int(np.asarray(tensors.get("optimizer.step", 0)))
    given = {name for name in tensors if name.startswith("optimizer.") and name != "optimizer.step"}
    known = {f"optimizer.{neutral}.{slot}" for neutral in parameters for slot in row.slots.values()}
    if given - known:
        raise KeyError(f"no torch parameter for optimizer slots {sorted(given - known)}")
    # fused or capturable Adam keeps its count as float32 on the parameters' device
    fused = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for neutral, (param, axes) in parameters.items():
        entry: dict[str, torch.Tensor] = {}
        for native, slot in row.slots.items():
            key = f"optimizer.{neutral}.{slot}"
            if key in tensors:
                entry[native] = from_neutral(tensors[key], axes, param)
        if entry and row.counts_steps:  # Adam's bias corrections read this count
            entry["step"] = (
                torch.tensor(float(step), dtype=torch.float32, device=param.device)
                if fused
                else torch.tensor(float(step), dtype=torch.get_default_dtype())
            )
        if sharded is not None:  # this rank's pieces of each slot
            sharded.load(param, entry)
        elif entry:
            optimizer.state[param] = entry
        else:
            optimizer.state.pop(param, None)
    return step


def grads_finite(parameters: Iterable[torch.nn.Parameter], sharded: bool = False) -> bool:
    """Whether every gradient (summed across replicas) is finite: one host read. Sharded
    (``sharded``): each rank checks its shards and the ranks agree (one all-reduce), so
    they all skip the same steps."""
    checks = [torch.isfinite(local(p.grad)).all() for p in parameters if p.grad is not None]
    finite = torch.stack(checks).all() if checks else torch.tensor(True)
    if sharded:
        import torch.distributed as dist

        flag = finite.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)
    return bool(finite)
