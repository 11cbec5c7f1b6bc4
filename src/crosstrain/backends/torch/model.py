"""The plan's model as a torch module, weights between neutral and torch layouts, and the
loss table.

The neutral model is a :class:`GraphModule`: one node module per graph node (the table in
layers.py), run in graph order. At the edges everything is neutral: NHWC inputs and outputs,
kernels [in, out] and [kh, kw, in, out], names ``{node.path}.{param}``. Inside, images run
in torch's NCHW between the nodes that can (layout.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.backends.native import native_factory
from crosstrain.backends.torch.layers import LAYERS
from crosstrain.backends.torch.layout import plan_layout
from crosstrain.backends.torch.nodes import ForwardContext, NodeModule
from crosstrain.backends.torch.sharding import copy_whole, is_sharded, shard_fully, sharded_like, whole
from crosstrain.core.model.graph import MODEL_INPUT, Graph
from crosstrain.core.model.optimizers import decayed_weights
from crosstrain.core.run.checkpoint import StreamedTensors
from crosstrain.core.spec.plan import LossSpec, Plan


def _module_key(path: str) -> str:
    return path.replace(".", "/")  # ModuleDict keys cannot hold dots


class GraphModule(nn.Module):
    """Runs the layout plan's steps in order; each node reads the outputs of its input
    nodes, in the order the plan chose for it."""

    def __init__(self, graph: Graph, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.layout = plan_layout(graph)
        self.nodes = nn.ModuleDict(
            {
                _module_key(node.path): LAYERS[node.layer.type].module(node.layer, node, first)
                for node, first in zip(graph.nodes, self.layout.channels_first, strict=True)
            }
        )
        for node in graph.nodes:  # a tied dense reads its embedding's table
            if node.tied_to is not None:
                tied = self.nodes[_module_key(node.path)]
                tied.tie(self.nodes[_module_key(graph.nodes[node.tied_to].path)])  # type: ignore[operator]
        for reader, padding in self.layout.absorbed.items():
            self.nodes[_module_key(graph.nodes[reader].path)].absorb(padding)  # type: ignore[operator]

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        step: int | torch.Tensor = 0,
        distributed: bool = False,
    ) -> torch.Tensor:
        context = ForwardContext(weight, rows, step, self.seed, distributed)
        values: dict[int, torch.Tensor] = {MODEL_INPUT: x}
        modules: list[NodeModule] = list(self.nodes.values())  # type: ignore[arg-type]
        for node, sources, target, permute in self.layout.steps:
            inputs = [values[source] for source in sources]
            values[target] = modules[node](inputs, context) if permute is None else permute(inputs[0])
        return values[self.layout.output]


def build_module(plan: Plan) -> nn.Module:
    """The plan's neutral model as a GraphModule, or the native factory's module."""
    if plan.model.native is not None:
        module = native_factory(plan, "torch")(plan)
        if not isinstance(module, nn.Module):
            raise TypeError(f"the native torch factory returned {type(module).__name__}, not nn.Module")
        return module
    module = GraphModule(plan.model.graph(plan.source), plan.seed)
    # convolution weights channels-last, as the images between them (layers.to_nchw)
    module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return module


def build_sharded_module(
    plan: Plan, weights: Mapping[str, np.ndarray], device: str, processes: int
) -> nn.Module:
    """The neutral model sharded "full" without a rank ever holding its whole parameters:
    built with them on torch's meta device (shapes, no storage), sharded there (FSDP2 keeps
    them on it), each rank's shards then allocated on ``device``, and the weights loaded one
    at a time, each rank keeping its shard of each. The buffers are made as usual: they hold
    what a layer computed when it was built (rotary tables, scales, counts)."""
    with _parameters_on_meta():
        module = build_module(plan)
    module.to(getattr(torch, plan.train.weight_dtype))
    shard_fully(module, plan, device, processes)
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    module.to_empty(device=device)  # FSDP2 allocates each shard; every buffer anew, refilled
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
    layouts = _layouts(plan)
    loaded = {layouts[neutral][0] for neutral in weights if neutral in layouts}
    missing = [name for name, _ in module.named_parameters() if name not in loaded]
    if missing:  # a shard left unloaded would train from whatever its allocation held
        raise KeyError(f"no starting weights for {missing}")
    load_neutral(module, plan, weights)
    return module


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers meanwhile moves to the meta device as it is
    registered (each one made on the host first, one at a time); buffers stay where they
    were made. Accelerate's ``init_empty_weights(include_buffers=False)`` works so."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# --------------------------------------------------------------------------- weight layouts


def _layouts(plan: Plan) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Neutral weight name -> (torch state_dict name, axes to go neutral -> torch)."""
    table: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for node in plan.model.graph().nodes:
        for neutral, (native, axes) in LAYERS[node.layer.type].layout.items():
            if neutral in node.weight_specs():
                table[f"{node.path}.{neutral}"] = (f"nodes.{_module_key(node.path)}.{native}", axes)
    return table


def _inverse(axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(axes))


def load_neutral(module: nn.Module, plan: Plan, weights: Mapping[str, np.ndarray]) -> None:
    """Copy neutral weights into the module (native models take native names as they are),
    cast to its dtype: float32 and float64 weights load into either. A sharded module's
    weights each keep their own rank's shard of the whole weight."""
    params = module.state_dict()
    sharded = any(is_sharded(tensor) for tensor in params.values())
    if plan.model.native is not None and not sharded:
        module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()})
        return
    if plan.model.native is not None:  # a sharded native model: every weight, as load_state_dict asks
        if set(weights) != set(params):
            raise KeyError(f"the native model's weights are {sorted(params)}, given {sorted(weights)}")
        layouts: dict[str, tuple[str, tuple[int, ...] | None]] = {name: (name, None) for name in params}
    else:
        layouts = _layouts(plan)
    unknown = sorted(set(weights) - set(layouts))
    if unknown:
        raise KeyError(f"no torch weight for neutral weights {unknown}")
    with torch.no_grad():
        for neutral, value in weights.items():
            native, axes = layouts[neutral]
            array = np.transpose(value, axes) if axes else value
            copy_whole(params[native], torch.from_numpy(np.ascontiguousarray(array)))


def neutral_state(module: nn.Module, plan: Plan) -> Mapping[str, np.ndarray]:
    """The module's weights (running statistics included) under neutral names and layouts,
    in the plan's weight dtype (float32; float64 under fp64). A sharded module's are
    streamed: each weight gathered whole only when it is read (every rank reads them, in
    order), so a rank never holds more than one whole weight beyond its shards."""
    dtype = getattr(torch, plan.train.weight_dtype)
    params = module.state_dict()
    if plan.model.native is not None:
        layouts: dict[str, tuple[str, tuple[int, ...] | None]] = {name: (name, None) for name in params}
    else:
        layouts = _layouts(plan)

    def read(neutral: str) -> np.ndarray:
        native, axes = layouts[neutral]
        # a copy: a numpy view of a live CPU parameter would change under later steps
        array = _host_copy(whole(params[native]), dtype)
        return np.ascontiguousarray(np.transpose(array, _inverse(axes)) if axes else array)

    if not any(is_sharded(tensor) for tensor in params.values()):
        return {neutral: read(neutral) for neutral in layouts}
    numpy_dtype = np.dtype(plan.train.weight_dtype)
    specs = {
        neutral: (neutral_shape(params[native].shape, axes), numpy_dtype)
        for neutral, (native, axes) in layouts.items()
    }
    return StreamedTensors(specs, read)


def neutral_shape(shape: torch.Size, axes: tuple[int, ...] | None) -> tuple[int, ...]:
    """The shape a tensor of torch's ``shape`` has in the neutral layout (a DTensor's shape
    is the whole tensor's)."""
    sizes = tuple(int(size) for size in shape)
    return tuple(sizes[axis] for axis in _inverse(axes)) if axes else sizes


# --------------------------------------------------------------------------- losses


def _cross_entropy_rows(outputs: torch.Tensor, targets: torch.Tensor, loss: LossSpec) -> torch.Tensor:
    """Logits [batch, ..., classes], targets [batch, ...]: the sum over each row's positions.
    Float targets [batch, 3] are a mixed row's (label, partner's label, lam) (mixup, cutmix):
    lam x the loss of the label + (1 - lam) x the loss of the partner's."""
    if targets.is_floating_point():
        own = _cross_entropy_rows(outputs, targets[:, 0].long(), loss)
        partner = _cross_entropy_rows(outputs, targets[:, 1].long(), loss)
        lam = targets[:, 2].to(own.dtype)
        return lam * own + (1 - lam) * partner
    classes = outputs.shape[-1]
    losses = F.cross_entropy(
        outputs.reshape(-1, classes),
        targets.reshape(-1),
        reduction="none",
        label_smoothing=loss.label_smoothing,
    )
    if outputs.dim() == 2:  # one position a row: its loss already is the row's (no extra kernel)
        return losses
    return losses.reshape(outputs.shape[0], -1).sum(dim=1)


def _mse_rows(outputs: torch.Tensor, targets: torch.Tensor, loss: LossSpec) -> torch.Tensor:
    """The mean squared error over each row's outputs."""
    return ((outputs - targets.reshape(outputs.shape)) ** 2).reshape(outputs.shape[0], -1).mean(dim=1)


def _binary_cross_entropy_rows(outputs: torch.Tensor, targets: torch.Tensor, loss: LossSpec) -> torch.Tensor:
    """Each output's sigmoid cross-entropy with its float target, averaged over the row."""
    labels = targets.reshape(outputs.shape).to(outputs.dtype)
    each = F.binary_cross_entropy_with_logits(outputs, labels, reduction="none")
    return each.reshape(outputs.shape[0], -1).mean(dim=1)


#: core loss name -> loss of each row, in the weights' dtype (float32; float64 under fp64)
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, LossSpec], torch.Tensor]] = {
    "cross_entropy": _cross_entropy_rows,
    "mse": _mse_rows,
    "binary_cross_entropy": _binary_cross_entropy_rows,
}


def full_precision(outputs: torch.Tensor) -> torch.Tensor:
    """The outputs in at least float32: bf16 and fp16 autocast's widened, float32 and
    float64 (fp64's) as they are. The loss is computed there whatever the precision."""
    return outputs.to(torch.promote_types(outputs.dtype, torch.float32))


def per_row_loss(loss: LossSpec, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return LOSSES[loss.name](full_precision(outputs), targets, loss)


def summed_loss(
    loss: LossSpec, outputs: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None
) -> torch.Tensor:
    """The loss summed over a micro-batch's real rows (``weight``: the row mask; None when
    every row is real). Without padding, cross entropy sums inside its own kernel: a step
    of a small model is bound by the host, and this is one launch and a few calls fewer."""
    if weight is None and loss.name == "cross_entropy" and not targets.is_floating_point():
        classes = outputs.shape[-1]
        flat = full_precision(outputs).reshape(-1, classes)
        return F.cross_entropy(
            flat, targets.reshape(-1), reduction="sum", label_smoothing=loss.label_smoothing
        )
    per_row = per_row_loss(loss, outputs, targets)
    return (per_row if weight is None else per_row * weight).sum()


def correct_per_row(outputs: torch.Tensor, targets: torch.Tensor, plan: Plan) -> torch.Tensor:
    """How many of each row's target positions the argmax of the logits gets right."""
    hits = outputs.argmax(dim=-1) == targets.reshape(outputs.shape[:-1])
    return hits.reshape(outputs.shape[0], -1).sum(dim=1)


def top_k_per_row(outputs: torch.Tensor, targets: torch.Tensor, plan: Plan) -> torch.Tensor:
    """How many of each row's target positions have fewer than ``plan.top_k`` logits above
    the target's (a tie counts for the target, as tf.math.in_top_k's)."""
    logits = full_precision(outputs)
    target = logits.gather(-1, targets.reshape(outputs.shape[:-1]).unsqueeze(-1))
    hits = (logits > target).sum(dim=-1) < plan.top_k
    return hits.reshape(outputs.shape[0], -1).sum(dim=1)


#: metric a backend counts -> (the eval sum it adds to, each row's hits)
METRIC_COUNTS: dict[str, tuple[str, Callable[[torch.Tensor, torch.Tensor, Plan], torch.Tensor]]] = {
    "accuracy": ("correct", correct_per_row),
    "top_k_accuracy": ("top_k_correct", top_k_per_row),
}


def neutral_parameters(
    module: nn.Module, plan: Plan
) -> dict[str, tuple[nn.Parameter, tuple[int, ...] | None]]:
    """Neutral name -> (the trainable parameter, axes neutral -> torch): what optimizer
    slots are named and laid out by. A native model's names are its own."""
    params = dict(module.named_parameters())
    if plan.model.native is not None:
        return {name: (param, None) for name, param in params.items()}
    return {
        neutral: (params[native], axes)
        for neutral, (native, axes) in _layouts(plan).items()
        if native in params
    }


def undecayed_parameters(module: nn.Module, plan: Plan) -> list[nn.Parameter]:
    """The trainable parameters ``optimizer.decay`` keeps weight decay off (core chooses,
    by neutral name: crosstrain.core.model.optimizers.decayed_weights)."""
    if plan.optimizer.decay == "all":
        return []
    decayed = decayed_weights(plan.model.graph().weight_specs(), plan.optimizer.decay)
    return [param for name, (param, _) in neutral_parameters(module, plan).items() if name not in decayed]


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A numpy copy of a weight or a slot, in ``dtype``."""
    return tensor.detach().to(dtype).cpu().numpy().copy()


def to_neutral(tensor: torch.Tensor, axes: tuple[int, ...] | None) -> np.ndarray:
    """A tensor shaped like a parameter (an optimizer slot), as a numpy copy in the neutral
    layout: float32, or float64 for a float64 one (fp64's); a sharded one gathered whole."""
    array = _host_copy(whole(tensor), torch.promote_types(tensor.dtype, torch.float32))
    return np.ascontiguousarray(np.transpose(array, _inverse(axes)) if axes else array)


def from_neutral(array: np.ndarray, axes: tuple[int, ...] | None, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_neutral`, on ``like``'s device and in its dtype (sharded as
    ``like`` is: this rank's shard of it)."""
    native = torch.from_numpy(np.ascontiguousarray(np.transpose(array, axes) if axes else array))
    if is_sharded(like):
        return sharded_like(native, like)
    # laid out like ``like`` (a channels-last convolution weight's slots are channels-last)
    return torch.empty_like(like).copy_(native)
