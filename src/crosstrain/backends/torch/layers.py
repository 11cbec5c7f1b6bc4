"""One torch module per neutral layer type: one row of ``LAYERS`` each (:class:`NodeSpec`).

Images are NHWC at the model's edges, as the neutral layouts are, but torch's convolutions
and pooling take NCHW shapes. So an image tensor is kept in torch's NCHW shape, laid out
channels-last in memory (the same bytes as NHWC: oneDNN and cuDNN convolve it natively, and
the model's convolution weights are channels-last too), between the nodes that can work in
it; a permute per node would cost views and copies. A row's ``order`` says whether its
layer needs NCHW (convolution, pooling), works in either order (activations, batch norm,
dropout, add, concat), reduces the image away (global pooling) or needs the neutral NHWC
order (flatten, dense, layer norm: what they compute depends on it). The graph module
(model.py) plans, once at build time, which node gets its image inputs in which order and
where a tensor is permuted; each builder is told ``channels_first``: whether its 4-D inputs
and output are NCHW. Each node module takes the list of its input tensors and the
:class:`ForwardContext` (the row mask, row positions and step that batch norm and dropout
need). What each layer computes is specified in docs/layers.md. The node modules of more
than a line live by family beside this table (dense.py, norms.py, sequences.py; the base in
nodes.py), as tf's Keras layers do; the convolutions, shapes, activations and merges here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.backends.torch.dense import (
    DropoutNode,
    LayerScaleNode,
    dense_node,
    rescale_node,
)
from crosstrain.backends.torch.nodes import ForwardContext, NodeModule, Order, UnaryNode, to_nhwc
from crosstrain.backends.torch.norms import BatchNormNode, LayerNormNode, RMSNormNode
from crosstrain.backends.torch.sequences import (
    AttentionNode,
    ClassTokenNode,
    EmbeddingNode,
    PositionEmbeddingNode,
    padding_mask,
)
from crosstrain.core.model.graph import Node
from crosstrain.core.model.layers import (
    AvgPool2D,
    Concat,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    GlobalAvgPool2D,
    Layer,
    MaxPool2D,
    Mean,
    Reshape,
    Softmax,
    Take,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.model.layers.sequences import ATTENTION_PROJECTIONS


class ConvNode(NodeModule):
    """Reads and writes NCHW (``Order.CHANNELS_FIRST``). ``same`` padding is TensorFlow's:
    an odd total puts its extra row or column at the bottom or right, padded explicitly."""

    def __init__(self, layer: Conv2D, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.pads = _padding_arguments(layer.paddings(node.input_shape))
        height, width = self.pads.symmetric
        self.conv = nn.Conv2d(
            node.input_shape[-1],
            layer.filters,
            layer.kernel_size,
            stride=layer.strides,
            padding=(height, width),
            dilation=layer.dilation,
            groups=layer.groups,
            bias=layer.use_bias,
        )

    def absorb(self, padding: tuple[int, int]) -> None:
        """Pad by ``padding`` (height, width) more on each side: a folded ``zero_pad2d``."""
        height, width = self.pads.symmetric  # the convolution's own
        self.conv.padding = (height + padding[0], width + padding[1])

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0] if self.pads.explicit is None else F.pad(inputs[0], self.pads.explicit)
        return self.conv(x)  # type: ignore[no-any-return]


class PoolNode(NodeModule):
    """Reads and writes NCHW (``Order.CHANNELS_FIRST``). ``same`` padding is explicit (its
    extra row or column after, which torch's symmetric ``padding`` cannot place): -inf for
    max, so padding never wins; zeros for avg, whose window sum is divided by the count of
    real cells (as TensorFlow), not by the window's size."""

    real_counts: torch.Tensor

    def __init__(self, layer: MaxPool2D | AvgPool2D, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.is_max = isinstance(layer, MaxPool2D)
        self.size, self.stride = layer.pool_size, layer.effective_strides
        (top, bottom), (left, right) = layer.paddings(node.input_shape)
        self.pads = (left, right, top, bottom) if layer.padding == "same" else None
        counts = torch.from_numpy(layer.real_counts(node.input_shape))
        self.register_buffer("real_counts", counts, persistent=False)
        self.padding = (0, 0)

    def absorb(self, padding: tuple[int, int]) -> None:
        """A valid max pool pads its never-negative input by ``padding`` (height, width) on
        each side: a folded ``zero_pad2d`` (torch pads with -inf, which loses as zeros do)."""
        self.padding = padding

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        if self.pads is None:
            pool = F.max_pool2d if self.is_max else F.avg_pool2d
            return pool(x, self.size, self.stride, self.padding)
        if self.is_max:
            return F.max_pool2d(F.pad(x, self.pads, value=-math.inf), self.size, self.stride)
        summed = F.avg_pool2d(F.pad(x, self.pads), self.size, self.stride, divisor_override=1)
        return summed / self.real_counts.to(summed.dtype)


class Conv1DNode(NodeModule):
    """A sequence [batch, length, channels] in the neutral order (``Order.NEUTRAL``): torch's
    conv1d reads [batch, channels, length], so it is permuted there and back."""

    def __init__(self, layer: Conv1D, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.pads = _padding_arguments((layer.paddings(node.input_shape),))
        (length,) = self.pads.symmetric
        self.conv = nn.Conv1d(
            node.input_shape[-1],
            layer.filters,
            layer.kernel_size,
            stride=layer.strides,
            padding=length,
            dilation=layer.dilation,
            groups=layer.groups,
            bias=layer.use_bias,
        )

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0].transpose(1, 2)
        if self.pads.explicit is not None:
            x = F.pad(x, self.pads.explicit)
        return self.conv(x).transpose(1, 2)  # type: ignore[no-any-return]


class ConvTransposeNode(NodeModule):
    """Reads and writes NCHW (``Order.CHANNELS_FIRST``): torch's transposed convolution
    without padding is the whole output; the layer's part of it (``crops``: where it
    starts, and zero rows after the end as output_padding) is Keras's."""

    def __init__(self, layer: Conv2DTranspose, node: Node, channels_first: bool) -> None:
        super().__init__()
        (top, extra_h), (left, extra_w) = layer.crops(node.input_shape)
        self.conv = nn.ConvTranspose2d(
            node.input_shape[-1],
            layer.filters,
            layer.kernel_size,
            stride=layer.strides,
            output_padding=(extra_h, extra_w),
            bias=layer.use_bias,
        )
        height, width, _ = node.output_shape
        self.window = (top, height, left, width)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        top, height, left, width = self.window
        return self.conv(inputs[0])[:, :, top : top + height, left : left + width]  # type: ignore[no-any-return]


class UpSampleNode(NodeModule):
    """Reads and writes NCHW (``Order.CHANNELS_FIRST``). Bilinear is torch's
    ``align_corners=False``: half-pixel centres, as tf.image.resize. Nearest repeats each
    row and column, as Keras does (F.interpolate's nearest computes floor(o * in / out) in
    float32, which a scale rounded down could put one row early)."""

    def __init__(self, layer: UpSample2D, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.size, self.factors = node.output_shape[:2], layer.size
        self.bilinear = layer.interpolation == "bilinear"

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        if self.bilinear:
            return F.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        batch, channels, height, width = x.shape
        rows, columns = self.factors
        repeated = x[:, :, :, None, :, None].expand(batch, channels, height, rows, width, columns)
        return repeated.reshape(batch, channels, height * rows, width * columns)


def _zero_pad(layer: ZeroPad2D, node: Node, channels_first: bool) -> NodeModule:
    (top, bottom), (left, right) = layer.padding
    return UnaryNode(partial(F.pad, pad=(left, right, top, bottom)))  # NCHW: width's pair first


def _crop(layer: Crop2D, node: Node, channels_first: bool) -> NodeModule:
    (top, bottom), (left, right) = layer.cropping
    height, width, _ = node.input_shape
    return UnaryNode(lambda x: x[:, :, top : height - bottom, left : width - right])  # NCHW


def _hard_swish(x: torch.Tensor) -> torch.Tensor:
    """Keras's hard_silu, differentiated as written (F.hardswish's gradient at -3 and 3 differs)."""
    return x * (F.relu6(x + 3.0) / 6.0)


def _softmax(layer: Softmax, node: Node, channels_first: bool) -> NodeModule:
    return UnaryNode(partial(F.softmax, dim=1 if channels_first else -1))  # the features


class MultiplyNode(NodeModule):
    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        product = inputs[0]
        for other in inputs[1:]:  # left to right, as every backend multiplies
            product = product * other
        return product


def _reshape(layer: Reshape, node: Node, channels_first: bool) -> NodeModule:
    shape = node.output_shape
    return UnaryNode(lambda x: x.reshape(x.shape[0], *shape))  # the neutral (row-major NHWC) order


def _transpose(layer: Transpose, node: Node, channels_first: bool) -> NodeModule:
    order = (0, *(axis + 1 for axis in layer.perm))
    return UnaryNode(lambda x: x.permute(order))


class MeanNode(NodeModule):
    """The mean over a row's neutral axes, of an NHWC or NCHW (``channels_first``) image
    (``Order.EITHER``): a kept image stays NCHW; one reduced to another rank is neutral."""

    def __init__(self, layer: Mean, node: Node, channels_first: bool) -> None:
        super().__init__()
        axes = layer.resolved_axes(len(node.input_shape))
        self.keepdims = layer.keepdims
        self.to_neutral = channels_first and not layer.keepdims
        if channels_first:  # neutral h, w, c are NCHW's axes 2, 3, 1
            self.axes = tuple(sorted((2, 3, 1)[axis] for axis in axes))
            self.neutral_axes = tuple(axis + 1 for axis in axes)
        else:
            self.axes = tuple(axis + 1 for axis in axes)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        if not self.to_neutral:
            return inputs[0].mean(dim=self.axes, keepdim=self.keepdims)
        kept = to_nhwc(inputs[0].mean(dim=self.axes, keepdim=True))
        return kept.squeeze(self.neutral_axes)


class _Pads(NamedTuple):
    """A convolution's padding as torch takes it: symmetric, inside the convolution, or
    else explicit (F.pad's order: the last axis's pair first) before one with none."""

    symmetric: tuple[int, ...]
    explicit: tuple[int, ...] | None


def _padding_arguments(pairs: tuple[tuple[int, int], ...]) -> _Pads:
    """From (before, after) per spatial axis: torch pads both sides of an axis alike, so
    TensorFlow's extra row at the bottom or right is padded explicitly."""
    if all(before == after for before, after in pairs):
        return _Pads(tuple(before for before, _ in pairs), None)
    return _Pads((0,) * len(pairs), tuple(side for pair in reversed(pairs) for side in pair))


class TakeNode(NodeModule):
    """Reads the neutral order (``Order.NEUTRAL``): the row's first axis is its first."""

    def __init__(self, layer: Take, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.index = layer.index

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0][:, self.index]


class AddNode(NodeModule):
    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        total = inputs[0]
        for other in inputs[1:]:  # left to right, as every backend sums
            total = total + other
        return total


class ConcatNode(NodeModule):
    """Joins on the features: the last axis, or axis 1 of NCHW images (``channels_first``)."""

    def __init__(self, layer: Concat, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.axis = 1 if channels_first else -1

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return torch.cat(inputs, dim=self.axis)


class GlobalPoolNode(NodeModule):
    """The mean over height and width, of an NHWC or NCHW (``channels_first``) image."""

    def __init__(self, layer: GlobalAvgPool2D, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.axes = (2, 3) if channels_first else (1, 2)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0].mean(dim=self.axes)


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)  # the plan hands it NHWC: the neutral order


LayerT = TypeVar("LayerT", bound=Layer)
#: a node module from its layer, its graph node, and whether its 4-D tensors are NCHW
Builder = Callable[[LayerT, Node, bool], NodeModule]
#: neutral param -> (torch name inside the node module, neutral->torch axes); None keeps the layout
Layout = Mapping[str, tuple[str, tuple[int, ...] | None]]


def _unary(function: Callable[[torch.Tensor], torch.Tensor]) -> Builder[Layer]:
    return lambda layer, node, channels_first: UnaryNode(function)


@attrs.frozen
class NodeSpec(Generic[LayerT]):
    """How one core layer type runs on torch: its node module, the order it works in on an
    image (see :class:`Order`), where its neutral weights sit in the module (empty: it has
    none), and, for a layer with an op a CUDA graph cannot capture, why."""

    module: Builder[LayerT]
    order: Order
    layout: Layout = attrs.field(factory=dict)
    uncapturable: str | None = None


_DENSE: Layout = {"kernel": ("linear.weight", (1, 0)), "bias": ("linear.bias", None)}
_ATTENTION: Layout = {
    f"{projection}_{param}": (f"{projection}.{native}", (1, 0) if param == "kernel" else None)
    for projection in ATTENTION_PROJECTIONS
    for param, native in (("kernel", "weight"), ("bias", "bias"))
}

#: a layer type's tag -> how it runs here, one row each; core's graph resolves blocks, so
#: ``block`` has no row. The keys are the backend's vocabulary of layers.
LAYERS: dict[str, NodeSpec[Any]] = {
    "dense": NodeSpec(dense_node, Order.NEUTRAL, _DENSE),  # on the last axis; tied: no kernel of its own
    "conv2d": NodeSpec(
        ConvNode, Order.CHANNELS_FIRST, {"kernel": ("conv.weight", (3, 2, 0, 1)), "bias": ("conv.bias", None)}
    ),
    "maxpool2d": NodeSpec(PoolNode, Order.CHANNELS_FIRST),
    "avgpool2d": NodeSpec(PoolNode, Order.CHANNELS_FIRST),
    "global_avg_pool2d": NodeSpec(GlobalPoolNode, Order.REDUCES),
    "flatten": NodeSpec(_unary(_flatten), Order.NEUTRAL),  # the neutral order of the elements is its output
    "conv1d": NodeSpec(  # a sequence, not an image
        Conv1DNode, Order.NEUTRAL, {"kernel": ("conv.weight", (2, 1, 0)), "bias": ("conv.bias", None)}
    ),
    "conv2d_transpose": NodeSpec(  # [kh, kw, out, in] -> torch's [in, out, kh, kw]
        ConvTransposeNode,
        Order.CHANNELS_FIRST,
        {"kernel": ("conv.weight", (3, 2, 0, 1)), "bias": ("conv.bias", None)},
    ),
    "upsample2d": NodeSpec(UpSampleNode, Order.CHANNELS_FIRST),
    "zero_pad2d": NodeSpec(_zero_pad, Order.CHANNELS_FIRST),
    "crop2d": NodeSpec(_crop, Order.CHANNELS_FIRST),
    "layer_scale": NodeSpec(LayerScaleNode, Order.NEUTRAL, {"scale": ("scale", None)}),  # on the last axis
    "sigmoid": NodeSpec(_unary(torch.sigmoid), Order.EITHER),
    "silu": NodeSpec(_unary(F.silu), Order.EITHER),
    "softmax": NodeSpec(_softmax, Order.EITHER),  # over the channel axis of either order
    "relu6": NodeSpec(_unary(F.relu6), Order.EITHER),  # gradient 0 at 0 and 6, as tf's
    "hard_swish": NodeSpec(_unary(_hard_swish), Order.EITHER),
    "multiply": NodeSpec(lambda layer, node, channels_first: MultiplyNode(), Order.EITHER),
    "reshape": NodeSpec(_reshape, Order.NEUTRAL),
    "transpose": NodeSpec(_transpose, Order.NEUTRAL),
    "mean": NodeSpec(MeanNode, Order.EITHER),
    "rescale": NodeSpec(rescale_node, Order.EITHER),
    "relu": NodeSpec(_unary(F.relu), Order.EITHER),
    "leaky_relu": NodeSpec(
        lambda layer, node, first: UnaryNode(partial(F.leaky_relu, negative_slope=layer.negative_slope)),
        Order.EITHER,
    ),
    "gelu": NodeSpec(_unary(F.gelu), Order.EITHER),  # erf, torch's default
    "tanh": NodeSpec(_unary(torch.tanh), Order.EITHER),
    "dropout": NodeSpec(DropoutNode, Order.EITHER),  # draws its mask in the input's order
    "layernorm": NodeSpec(
        LayerNormNode, Order.NEUTRAL, {"scale": ("norm.weight", None), "offset": ("norm.bias", None)}
    ),  # on the last axis
    "batchnorm": NodeSpec(  # on the channel axis of either order
        BatchNormNode,
        Order.EITHER,
        {name: (name, None) for name in ("scale", "offset", "moving_mean", "moving_variance")},
    ),
    "embedding": NodeSpec(  # token ids are never an image
        EmbeddingNode,
        Order.NEUTRAL,
        {"table": ("table.weight", None)},
        uncapturable="an embedding's backward syncs with the host (pytorch#82886)",
    ),
    "position_embedding": NodeSpec(PositionEmbeddingNode, Order.NEUTRAL, {"table": ("table", None)}),
    "attention": NodeSpec(AttentionNode, Order.NEUTRAL, _ATTENTION),
    "rmsnorm": NodeSpec(RMSNormNode, Order.NEUTRAL, {"scale": ("scale", None)}),  # on the last axis
    "class_token": NodeSpec(ClassTokenNode, Order.NEUTRAL, {"token": ("token", None)}),
    "take": NodeSpec(TakeNode, Order.NEUTRAL),
    "padding_mask": NodeSpec(lambda layer, node, first: UnaryNode(padding_mask(layer)), Order.NEUTRAL),
    "add": NodeSpec(lambda layer, node, channels_first: AddNode(), Order.EITHER),
    "concat": NodeSpec(ConcatNode, Order.EITHER),  # on the channel axis of either order
}
