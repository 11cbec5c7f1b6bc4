"""The plan's model as a torch module, weights between neutral and torch layouts, and the
loss table.

The neutral model is a :class:`GraphModule`: one node module per graph node (the table in
layers.py), run in graph order. At the edges everything is neutral: NHWC inputs, kernels
[in, out] and [kh, kw, in, out], names ``{node.path}.{param}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.backends.common import native_factory
from crosstrain.backends.torch.layers import LAYERS, LAYOUTS, ForwardContext, NodeModule
from crosstrain.core.graph import Graph
from crosstrain.core.plan import Plan


def _module_key(path: str) -> str:
    return path.replace(".", "/")  # ModuleDict keys cannot hold dots


class GraphModule(nn.Module):
    """Runs the graph's nodes in order; each reads the outputs of its input nodes."""

    def __init__(self, graph: Graph, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.inputs = [node.inputs for node in graph.nodes]
        self.output = graph.output
        self.nodes = nn.ModuleDict(
            {_module_key(node.path): LAYERS[type(node.layer)](node.layer, node) for node in graph.nodes}
        )

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        step: int = 0,
        distributed: bool = False,
    ) -> torch.Tensor:
        context = ForwardContext(weight, rows, step, self.seed, distributed)
        values: dict[int, torch.Tensor] = {-1: x}
        modules: list[NodeModule] = list(self.nodes.values())  # type: ignore[arg-type]
        for index, (module, sources) in enumerate(zip(modules, self.inputs, strict=True)):
            values[index] = module([values[source] for source in sources], context)
        return values[self.output]


def build_module(plan: Plan) -> nn.Module:
    """The plan's neutral model as a GraphModule, or the native factory's module."""
    if plan.model.native is not None:
        module = native_factory(plan, "torch")(plan)
        if not isinstance(module, nn.Module):
            raise TypeError(f"the native torch factory returned {type(module).__name__}, not nn.Module")
        return module
    return GraphModule(plan.model.graph(plan.source), plan.seed)


# --------------------------------------------------------------------------- weight layouts


def _layouts(plan: Plan) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Neutral weight name -> (torch state_dict name, axes to go neutral -> torch)."""
    table: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for node in plan.model.graph().nodes:
        layout = LAYOUTS.get(type(node.layer), {})  # a layer without a row has no weights
        for neutral, (native, axes) in layout.items():
            if neutral in node.weight_specs():
                table[f"{node.path}.{neutral}"] = (f"nodes.{_module_key(node.path)}.{native}", axes)
    return table


def _inverse(axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(axes))


def load_neutral(module: nn.Module, plan: Plan, weights: Mapping[str, np.ndarray]) -> None:
    """Copy neutral weights into the module (native models take native names as they are)."""
    if plan.model.native is not None:
        module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()})
        return
    params = module.state_dict()
    layouts = _layouts(plan)
    unknown = sorted(set(weights) - set(layouts))
    if unknown:
        raise KeyError(f"no torch weight for neutral weights {unknown}")
    with torch.no_grad():
        for neutral, value in weights.items():
            native, axes = layouts[neutral]
            array = np.transpose(value, axes) if axes else value
            params[native].copy_(torch.from_numpy(np.ascontiguousarray(array)))


def neutral_state(module: nn.Module, plan: Plan) -> dict[str, np.ndarray]:
    """The module's weights (running statistics included) under neutral names and layouts."""
    # copies: numpy views of live CPU parameters would change under later optimizer steps
    params = {k: v.detach().float().cpu().numpy().copy() for k, v in module.state_dict().items()}
    if plan.model.native is not None:
        return params
    state: dict[str, np.ndarray] = {}
    for neutral, (native, axes) in _layouts(plan).items():
        array = params[native]
        state[neutral] = np.ascontiguousarray(np.transpose(array, _inverse(axes)) if axes else array)
    return state


# --------------------------------------------------------------------------- losses


def _cross_entropy_rows(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logits [batch, ..., classes], targets [batch, ...]: the sum over each row's positions."""
    classes = outputs.shape[-1]
    losses = F.cross_entropy(outputs.reshape(-1, classes), targets.reshape(-1), reduction="none")
    if outputs.dim() == 2:  # one position a row: its loss already is the row's (no extra kernel)
        return losses
    return losses.reshape(outputs.shape[0], -1).sum(dim=1)


def _mse_rows(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean squared error over each row's outputs."""
    return ((outputs - targets.reshape(outputs.shape)) ** 2).reshape(outputs.shape[0], -1).mean(dim=1)


#: core loss name -> loss of each row, in float32
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _cross_entropy_rows,
    "mse": _mse_rows,
}


def per_row_loss(name: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return LOSSES[name](outputs.float(), targets)


def correct_per_row(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many of each row's target positions the argmax of the logits gets right."""
    hits = outputs.argmax(dim=-1) == targets.reshape(outputs.shape[:-1])
    return hits.reshape(outputs.shape[0], -1).sum(dim=1)


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


def to_neutral(tensor: torch.Tensor, axes: tuple[int, ...] | None) -> np.ndarray:
    """A tensor shaped like a parameter, as a float32 numpy copy in the neutral layout."""
    array = tensor.detach().float().cpu().numpy().copy()
    return np.ascontiguousarray(np.transpose(array, _inverse(axes)) if axes else array)


def from_neutral(array: np.ndarray, axes: tuple[int, ...] | None, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_neutral`, on ``like``'s device and in its dtype."""
    native = np.ascontiguousarray(np.transpose(array, axes) if axes else array)
    return torch.from_numpy(native).to(device=like.device, dtype=like.dtype)
