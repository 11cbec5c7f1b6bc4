"""Converters of the torch importer, part one: weights in neutral layouts, Linear and
convolutions, pooling, and the shape ops (flatten, mean, cat). The table that keys them is
:data:`crosstrain.importers.torch_table.CONVERTERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn

from crosstrain.backends.torch.layers import LAYERS as TORCH_LAYERS
from crosstrain.core.layers import (
    AvgPool2D,
    Concat,
    Conv2D,
    Dense,
    Flatten,
    Layer,
    MaxPool2D,
    Mean,
    ZeroPad2D,
)
from crosstrain.importers.common import Conversion, Piece, Weights
from crosstrain.importers.torch_steps import Step, Value


def _neutral(layer_type: type[Layer], param: str, tensor: torch.Tensor) -> np.ndarray:
    """A torch weight in its neutral layout: the torch backend's layout (neutral -> torch
    axes, :data:`crosstrain.backends.torch.layers.LAYERS`) undone."""
    _, axes = TORCH_LAYERS[layer_type].layout[param]
    array = tensor.detach().to("cpu", torch.float32).numpy()
    return array if axes is None else np.ascontiguousarray(array.transpose(np.argsort(axes)))


def _module_weights(layer_type: type[Layer], module: nn.Module, names: Mapping[str, str]) -> Weights:
    """The module's tensors ``names`` (neutral param -> torch attribute) that exist."""
    weights: Weights = {}
    for param, attribute in names.items():
        tensor = getattr(module, attribute, None)
        if tensor is not None:
            weights[param] = _neutral(layer_type, param, tensor)
    return weights


def _module(step: Step) -> Any:
    assert step.module is not None
    return step.module


def _linear(step: Step) -> Conversion:
    if step.inputs[0].image:
        raise step.refuse(
            "reads an image (NCHW); torch's Linear would act on its width, the plan's dense on channels"
        )
    linear = _module(step)
    dense = Dense(units=linear.out_features, use_bias=linear.bias is not None)
    return (Piece(dense, _module_weights(Dense, linear, {"kernel": "weight", "bias": "bias"})),)


def _linear_reading_order(step: Step, order: np.ndarray) -> Conversion:
    """A Linear after flattening an image: plan feature i is torch feature order[i], so the
    plan kernel's row i is torch weight's column order[i]."""
    (piece,) = _linear(step)
    weights = dict(piece.weights)
    weights["kernel"] = np.ascontiguousarray(weights["kernel"][order])
    return (attrs.evolve(piece, weights=weights),)


def _pair(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _conv2d(step: Step) -> Conversion:
    """torch's padding p (zeros on both sides): TensorFlow's ``same`` where it is that
    (stride 1, 2p = the window - 1), else a zero_pad2d then a ``valid`` convolution."""
    conv = _module(step)
    step.option("padding_mode", conv.padding_mode, "zeros", "the plan's convolutions pad with zeros")
    kernel, strides, dilation = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.dilation)
    weights = _module_weights(Conv2D, conv, {"kernel": "weight", "bias": "bias"})
    options = {
        "filters": conv.out_channels,
        "kernel_size": kernel,
        "strides": strides,
        "dilation": dilation,
        "groups": conv.groups,
        "use_bias": conv.bias is not None,
    }
    if conv.padding == "same":
        return (Piece(Conv2D(padding="same", **options), weights),)
    padding = (0, 0) if conv.padding == "valid" else _pair(conv.padding)
    windows = [(size - 1) * rate + 1 for size, rate in zip(kernel, dilation, strict=True)]
    if padding == (0, 0):
        return (Piece(Conv2D(padding="valid", **options), weights),)
    if strides == (1, 1) and all(2 * pad == window - 1 for pad, window in zip(padding, windows, strict=True)):
        return (Piece(Conv2D(padding="same", **options), weights),)
    pad = ZeroPad2D(padding=((padding[0], padding[0]), (padding[1], padding[1])))
    return (Piece(pad, suffix="pad"), Piece(Conv2D(padding="valid", **options), weights))


def _pool(kind: type[MaxPool2D] | type[AvgPool2D]) -> Callable[[Step], Conversion]:
    def convert(step: Step) -> Conversion:
        pool = _module(step)
        step.option("padding", _pair(pool.padding), ((0, 0),), "a plan's pools are 'valid' (no padding)")
        step.option("ceil_mode", pool.ceil_mode, False, "a plan's pools drop a partial window")
        if kind is MaxPool2D:
            step.option("dilation", _pair(pool.dilation), ((1, 1),), "a plan's pools have no dilation")
            step.option("return_indices", pool.return_indices, False, "a plan layer has one output")
        else:
            step.option(
                "divisor_override", pool.divisor_override, None, "a plan's average divides by the window"
            )
        size = _pair(pool.kernel_size)
        strides = _pair(pool.stride or pool.kernel_size)
        if len(set(size)) != 1 or len(set(strides)) != 1:
            raise step.refuse(f"kernel_size={size} stride={strides}: a plan's pools are square")
        return (Piece(kind(pool_size=size[0], strides=None if strides == size else strides[0])),)

    return convert


def _adaptive_avg_pool(step: Step) -> Conversion:
    """AdaptiveAvgPool2d(1): the mean over height and width, kept as [1, 1, C]."""
    step.option(
        "output_size", _pair(_module(step).output_size), ((1, 1),), "the plan averages a whole image only"
    )
    return (Piece(Mean(axes=(0, 1), keepdims=True)),)


def _flatten(step: Step, start: int, end: int) -> Conversion:
    """Flatten from axis 1 to the last: an image's features (C, H, W in torch) record their
    order for the Linear that reads them."""
    value = step.inputs[0]
    rank = len(value.shape)
    if start != 1 or end not in (-1, rank - 1):
        raise step.refuse(f"start_dim={start} end_dim={end}: the plan flattens every axis of a row")
    return (Piece(Flatten()),)


def _flatten_order(value: Value) -> np.ndarray | None:
    """Plan feature i (H, W, C order) is torch feature order[i] (C, H, W); None when equal."""
    if not value.image:
        return None
    channels, height, width = value.shape[1:]
    order = np.arange(channels * height * width).reshape(channels, height, width).transpose(1, 2, 0).ravel()
    return None if np.array_equal(order, np.arange(order.size)) else order


def _flatten_module(step: Step) -> Conversion:
    flatten = _module(step)
    return _flatten(step, flatten.start_dim, flatten.end_dim)


def _flatten_call(step: Step) -> Conversion:
    return _flatten(step, step.argument(1, "start_dim", 0), step.argument(2, "end_dim", -1))


def _mean_call(step: Step) -> Conversion:
    dims = step.argument(1, "dim", None)
    if dims is None:
        raise step.refuse("a mean over the batch too: the plan's mean is within a row")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    keepdims = bool(step.argument(2, "keepdim", False))
    if step.argument(3, "dtype", None) is not None:
        raise step.refuse("dtype: the plan's mean keeps the compute dtype")
    axes = tuple(sorted(step.plan_axis(dim) for dim in dims))
    return (Piece(Mean(axes=axes, keepdims=keepdims)),)


def _concat(step: Step) -> Conversion:
    dim = step.argument(1, "dim", 0)
    rank = len(step.inputs[0].shape)
    if step.plan_axis(dim) != rank - 2:
        raise step.refuse(f"dim={dim}: the plan's concat joins channels (the last axis channels-last)")
    return (Piece(Concat()),)
