"""Converters of the torch importer, part one: weights in neutral layouts, Linear and
convolutions, pooling, and the shape ops (flatten, mean, cat). The table that keys them is
:data:`crosstrain.importers.torch_table.CONVERTERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import numpy as np
import torch
from torch import nn

from crosstrain.backends.torch.layers import LAYERS as TORCH_LAYERS
from crosstrain.core.model.layers import (
    AvgPool2D,
    Concat,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    Dense,
    Flatten,
    Layer,
    MaxPool2D,
    Mean,
    Reshape,
    Take,
    Transpose,
    ZeroPad2D,
)
from crosstrain.importers.common import Conversion, Piece, Weights
from crosstrain.importers.torch_steps import BATCH, Step, Value


def _neutral(layer_type: type[Layer], param: str, tensor: torch.Tensor) -> np.ndarray:
    """A torch weight in its neutral layout: the torch backend's layout (neutral -> torch
    axes, :data:`crosstrain.backends.torch.layers.LAYERS`) undone."""
    _, axes = TORCH_LAYERS[layer_type.type].layout[param]
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


def _channels_first(piece: Piece) -> Conversion:
    """``piece``, which reads and gives the plan's [length, channels], between transposes
    from and to torch's [channels, length], the layout the plan keeps for a 3-D tensor; the
    module's own layer keeps its name (and weights), the last transpose's name its output."""
    swap = Transpose(perm=(1, 0))
    return (Piece(swap, suffix="length_first"), piece, Piece(swap, suffix="channels_first"))


def _conv1d(step: Step) -> Conversion:
    """torch's Conv1d on [batch, C, L]: the plan's conv1d on [L, C], between transposes;
    padding 0 (``valid``) or ``same`` (stride 1, 2p = the window - 1, or ``"same"``)."""
    conv = _module(step)
    step.option("padding_mode", conv.padding_mode, "zeros", "the plan's convolutions pad with zeros")
    (kernel,), (stride,), (dilation,) = conv.kernel_size, conv.stride, conv.dilation
    padding = conv.padding if isinstance(conv.padding, str) else conv.padding[0]
    mode: Literal["valid", "same"]
    if padding in (0, "valid"):
        mode = "valid"
    elif padding == "same" or (stride == 1 and 2 * padding == (kernel - 1) * dilation):
        mode = "same"
    else:
        raise step.refuse(
            f"padding={padding} stride={stride}: the plan's conv1d pads 'valid' (0) or 'same' "
            f"(stride 1, 2 x padding = the window - 1)"
        )
    layer = Conv1D(
        filters=conv.out_channels,
        kernel_size=kernel,
        strides=stride,
        padding=mode,
        dilation=dilation,
        groups=conv.groups,
        use_bias=conv.bias is not None,
    )
    weights = _module_weights(Conv1D, conv, {"kernel": "weight", "bias": "bias"})
    return _channels_first(Piece(layer, weights))


def _conv_transpose2d(step: Step) -> Conversion:
    """torch's ConvTranspose2d keeps, on each axis, the positions of the full transposed
    convolution from ``padding`` on, as many as its output has: the plan's conv2d_transpose
    where Keras's ``valid`` or ``same`` keeps the same ones, else a ``valid`` one (the full
    output) and a crop2d."""
    conv = _module(step)
    step.option("padding_mode", conv.padding_mode, "zeros", "the plan's convolutions pad with zeros")
    step.option("dilation", _pair(conv.dilation), ((1, 1),), "the plan's conv2d_transpose has no dilation")
    step.option("groups", conv.groups, 1, "the plan's conv2d_transpose is not grouped")
    image = _channels_last(step.inputs[0].shape[1:])
    wanted = (*_channels_last(step.shape[1:])[:2],)
    padding = _pair(conv.padding)
    for mode in ("valid", "same"):
        layer = Conv2DTranspose(
            filters=conv.out_channels,
            kernel_size=_pair(conv.kernel_size),
            strides=_pair(conv.stride),
            padding=mode,
            use_bias=conv.bias is not None,
        )
        starts = tuple(start for start, _ in layer.crops(image))
        if layer.output_shape(image)[:2] == wanted and starts == padding:
            weights = _module_weights(Conv2DTranspose, conv, {"kernel": "weight", "bias": "bias"})
            return (Piece(layer, weights),)
    # else the full output (valid), cropped to what torch keeps of it
    valid = attrs.evolve(layer, padding="valid")
    full = valid.output_shape(image)[:2]
    crops = tuple((pad, size - pad - kept) for pad, size, kept in zip(padding, full, wanted, strict=True))
    if any(after < 0 for _, after in crops):
        raise step.refuse(
            f"padding={padding} output_padding={_pair(conv.output_padding)}: torch's output runs past "
            f"the full transposed convolution; the plan's conv2d_transpose and crop2d keep part of it"
        )
    weights = _module_weights(Conv2DTranspose, conv, {"kernel": "weight", "bias": "bias"})
    return (Piece(valid, weights, suffix="full"), Piece(Crop2D(cropping=(crops[0], crops[1]))))


def _channels_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A row of torch's shape in the plan's layout: an image [C, H, W] is [H, W, C]."""
    if len(shape) == 3:
        channels, height, width = shape
        return (height, width, channels)
    return shape


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
    order for the Linear that reads them. From a later axis (``x.flatten(2)``, ViT's
    patches): a reshape in torch's order."""
    value = step.inputs[0]
    rank = len(value.shape)
    if start in (0, -rank):
        raise step.refuse(f"start_dim={start}: the plan's rows keep the batch axis")
    if start == 1 and end in (-1, rank - 1):
        return (Piece(Flatten()),)
    return _reshaped(step)


def _reshaped(step: Step) -> Conversion:
    """Each row to the node's torch shape, row-major in torch's order: an image read as
    torch's [C, H, W] first (a transpose), an image result made the plan's [H, W, C] after.
    An image to a vector is a flatten (its order kept for the Linear that reads it)."""
    value = step.inputs[0]
    source, target = value.shape[1:], step.shape[1:]
    if value.image and len(target) == 1:
        return (Piece(Flatten()),)
    if source == target and not value.image:
        return ()
    pieces: list[Piece] = []
    if value.image:
        pieces.append(Piece(Transpose(perm=(2, 0, 1)), suffix="channels_first"))
    if len(target) == 3:
        pieces.append(Piece(Reshape(target_shape=target), suffix="reshape"))
        pieces.append(Piece(Transpose(perm=(1, 2, 0))))
    else:
        pieces.append(Piece(Reshape(target_shape=target)))
    return tuple(pieces)


def _view(step: Step) -> Conversion:
    """``x.view(x.size(0), -1)``, ``x.reshape(batch, ...)``, ``torch.reshape(x, (-1, n))``:
    the first size is the batch (``x.size(0)``, or -1 with the row's sizes after it); each
    row then becomes the node's shape (:func:`_reshaped`)."""
    sizes = step.arguments[1:]
    if len(sizes) == 1 and isinstance(sizes[0], tuple | list):
        sizes = tuple(sizes[0])
    keeps_batch = bool(sizes) and (sizes[0] is BATCH or sizes[0] == -1)
    if not keeps_batch or step.shape[:1] != step.inputs[0].shape[:1]:
        shown = ["x.size(0)" if size is BATCH else size for size in sizes]
        raise step.refuse(
            f"sizes {shown}: the plan reshapes each row; the first size must be the batch "
            f"(x.size(0), or -1 followed by the row's sizes)"
        )
    return _reshaped(step)


def _size(step: Step) -> Any:
    """``x.size(d)``: the batch (d = 0: a marker a view reads) or the fixed size of axis d;
    ``x.size()``: all of them."""
    shape = step.inputs[0].shape
    sizes = (BATCH, *shape[1:])
    dim = step.argument(1, "dim", None)
    return sizes if dim is None else sizes[dim]


def _take(step: Step) -> Conversion:
    """``x[:, i]`` on a sequence [batch, length, ...]: one position (the plan's take)."""
    value = step.inputs[0]
    (key,) = step.constants
    whole = slice(None)
    if (
        not isinstance(key, tuple)
        or len(key) < 2
        or key[0] != whole
        or not isinstance(key[1], int)
        or any(item not in (whole, Ellipsis) for item in key[2:])
        or value.image
        or len(value.shape) < 3
    ):
        raise step.refuse(
            f"index {key!r}: the plan takes one position of a sequence, x[:, i] on [batch, length, ...]"
        )
    return (Piece(Take(index=key[1])),)


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
