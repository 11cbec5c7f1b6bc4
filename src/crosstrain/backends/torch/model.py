"""Neutral layers as a torch module, and weights between neutral and torch layouts.

Inside the module images are NCHW (torch's layout); at the edges everything is
neutral: input NHWC, Flatten in NHWC order, kernels [in, out] and [kh, kw, in, out].
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from crosstrain.backends.common import native_factory
from crosstrain.core.layers import (
    GELU,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    Layer,
    LayerNorm,
    MaxPool2D,
    ReLU,
    Tanh,
    infer_shapes,
    layer_name,
)
from crosstrain.core.plan import Plan


class ToChannelsFirst(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A fresh NCHW copy with standard strides: a permuted view (even .contiguous() of one,
        # when C is 1) makes conv produce channels-last weight gradients, which DDP's buckets
        # then copy and warn about.
        return x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)


class NeutralFlatten(nn.Module):
    """Flatten in NHWC order, so the next Dense kernel means what it means in every backend."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.permute(0, 2, 3, 1)
        return x.flatten(1)


class ChannelsLastNorm(nn.Module):
    """LayerNorm over channels while the tensor is NCHW."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            return self.norm(x)  # type: ignore[no-any-return]
        normed: torch.Tensor = self.norm(x.permute(0, 2, 3, 1))
        return normed.permute(0, 3, 1, 2)


def _torch_layer(layer: Layer, input_shape: tuple[int, ...]) -> nn.Module:
    if isinstance(layer, Dense):
        return nn.Linear(input_shape[-1], layer.units, bias=layer.use_bias)
    if isinstance(layer, Conv2D):
        return nn.Conv2d(
            input_shape[-1],
            layer.filters,
            layer.kernel_size,
            stride=layer.strides,
            padding=layer.padding,
            bias=layer.use_bias,
        )
    if isinstance(layer, MaxPool2D):
        return nn.MaxPool2d(layer.pool_size, stride=layer.effective_strides)
    if isinstance(layer, Flatten):
        return NeutralFlatten()
    if isinstance(layer, LayerNorm):
        return ChannelsLastNorm(nn.LayerNorm(input_shape[-1], eps=layer.eps))
    if isinstance(layer, Dropout):
        return nn.Dropout(layer.rate)
    simple: dict[type[Layer], type[nn.Module]] = {ReLU: nn.ReLU, GELU: nn.GELU, Tanh: nn.Tanh}
    return simple[type(layer)]()


def build_module(plan: Plan) -> nn.Module:
    """The plan's model as an nn.Sequential whose children carry the neutral layer names."""
    if plan.model.native is not None:
        module = native_factory(plan, "torch")(plan)
        if not isinstance(module, nn.Module):
            raise TypeError(f"the native torch factory returned {type(module).__name__}, not nn.Module")
        return module
    children: dict[str, nn.Module] = {}
    if len(plan.model.input_shape) == 3:
        children["to_channels_first"] = ToChannelsFirst()
    shapes = [tuple(plan.model.input_shape), *infer_shapes(plan.model.input_shape, plan.model.layers)]
    for index, layer in enumerate(plan.model.layers):
        children[layer_name(layer, index)] = _torch_layer(layer, shapes[index])
    return nn.Sequential(OrderedDict(children))


# --------------------------------------------------------------------------- weight layouts

# neutral param -> (torch param, neutral->torch transpose); None keeps the layout
_Layout = dict[str, tuple[str, tuple[int, ...] | None]]
_DENSE: _Layout = {"kernel": ("weight", (1, 0)), "bias": ("bias", None)}
_CONV: _Layout = {"kernel": ("weight", (3, 2, 0, 1)), "bias": ("bias", None)}
_NORM: _Layout = {"scale": ("norm.weight", None), "offset": ("norm.bias", None)}
_LAYOUTS_BY_TYPE: dict[type[Layer], _Layout] = {
    Dense: _DENSE,
    Conv2D: _CONV,
    LayerNorm: _NORM,
}


def _layouts(plan: Plan) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Neutral weight name -> (torch state_dict name, axes to go neutral -> torch)."""
    table: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for index, layer in enumerate(plan.model.layers):
        name = layer_name(layer, index)
        mapping = _LAYOUTS_BY_TYPE.get(type(layer), {})
        for neutral, (native, axes) in mapping.items():
            table[f"{name}.{neutral}"] = (f"{name}.{native}", axes)
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
    with torch.no_grad():
        for neutral, value in weights.items():
            native, axes = layouts[neutral]
            array = np.transpose(value, axes) if axes else value
            params[native].copy_(torch.from_numpy(np.ascontiguousarray(array)))


def neutral_state(module: nn.Module, plan: Plan) -> dict[str, np.ndarray]:
    """The module's weights under neutral names and channels-last layouts."""
    # copies: numpy views of live CPU parameters would change under later optimizer steps
    params = {k: v.detach().float().cpu().numpy().copy() for k, v in module.state_dict().items()}
    if plan.model.native is not None:
        return params
    state: dict[str, np.ndarray] = {}
    for neutral, (native, axes) in _layouts(plan).items():
        array = params[native]
        state[neutral] = np.ascontiguousarray(np.transpose(array, _inverse(axes)) if axes else array)
    return state


def per_row_loss(name: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Loss of each row, in float32: cross-entropy on logits, or MSE averaged over outputs."""
    outputs = outputs.float()
    if name == "cross_entropy":
        return nn.functional.cross_entropy(outputs, targets, reduction="none")
    return ((outputs - targets) ** 2).mean(dim=1)
