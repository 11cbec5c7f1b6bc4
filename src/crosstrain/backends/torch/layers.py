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
need). What each layer computes is specified in docs/layers.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.core import dropout as neutral_dropout
from crosstrain.core.graph import Node
from crosstrain.core.layers import (
    GELU,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    ClassToken,
    Concat,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    HardSwish,
    Layer,
    LayerNorm,
    LayerScale,
    LeakyReLU,
    MaxPool2D,
    Mean,
    Multiply,
    PaddingMask,
    PositionEmbedding,
    ReLU,
    ReLU6,
    Rescale,
    Reshape,
    RMSNorm,
    Sigmoid,
    SiLU,
    Softmax,
    Take,
    Tanh,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.layers.sequences import ATTENTION_PROJECTIONS, rotary_tables


class ForwardContext(NamedTuple):
    """What a training forward needs beyond the inputs: the row mask (1 real, 0 padding;
    None when every row is real), each row's position in the global batch, the optimizer
    step, the plan's seed, and whether batch statistics are summed across processes. (A NamedTuple, not attrs:
    torch.compile traces through a tuple, not through attrs' frozen ``__setattr__``.)"""

    weight: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    step: int | torch.Tensor = 0  # a device counter when the step is a CUDA graph's replay
    seed: int = 0
    distributed: bool = False


class NodeModule(nn.Module):
    """A graph node: ``forward(inputs, context)``."""

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        raise NotImplementedError


class _Unary(NodeModule):
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.function(inputs[0])


def to_nchw(x: torch.Tensor) -> torch.Tensor:
    """NHWC -> NCHW in torch's channels-last memory format: the same bytes (a view, no copy,
    when the NHWC tensor is contiguous), which CPU (oneDNN) and GPU (cuDNN) convolutions run
    natively and elementwise ops keep. The model's convolution weights are channels-last
    too (`build_module`), so their gradients match them (DDP's buckets copy and
    warn about a gradient laid out unlike its weight)."""
    return x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)


def to_nhwc(x: torch.Tensor) -> torch.Tensor:
    """NCHW -> the neutral NHWC, as a view: what reads it next (flatten's reshape, a dense
    layer's matmul, the loss) copies or reads it as it needs."""
    return x.permute(0, 2, 3, 1)


class Order(enum.Enum):
    """How a layer type works on an image (a 4-D tensor); other tensors are always neutral."""

    #: reads and writes NCHW: its 4-D inputs are permuted to NCHW first
    CHANNELS_FIRST = "channels_first"
    #: works in the order of its inputs and writes its output in it (inputs in both orders:
    #: the NHWC ones are permuted to NCHW)
    EITHER = "either"
    #: reads either order; its output has no spatial axes, so no order
    REDUCES = "reduces"
    #: reads NHWC, the neutral order: what it computes depends on the order of the elements
    NEUTRAL = "neutral"


class DenseNode(NodeModule):
    def __init__(self, layer: Dense, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(node.input_shape[-1], layer.units, bias=layer.use_bias)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        # the function, not the submodule's call: a small model's step is bound by the
        # host's Python, and the weights keep their ``linear.*`` names
        return F.linear(inputs[0], self.linear.weight, self.linear.bias)


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
    return _Unary(partial(F.pad, pad=(left, right, top, bottom)))  # NCHW: width's pair first


def _crop(layer: Crop2D, node: Node, channels_first: bool) -> NodeModule:
    (top, bottom), (left, right) = layer.cropping
    height, width, _ = node.input_shape
    return _Unary(lambda x: x[:, :, top : height - bottom, left : width - right])  # NCHW


class LayerScaleNode(NodeModule):
    """``x * scale`` over the last axis, the scale cast to the input's dtype (as Keras casts
    its LayerScale's weight to the compute dtype)."""

    def __init__(self, layer: LayerScale, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(node.input_shape[-1]))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0] * self.scale.to(inputs[0].dtype)


def _hard_swish(x: torch.Tensor) -> torch.Tensor:
    """Keras's hard_silu, differentiated as written (F.hardswish's gradient at -3 and 3 differs)."""
    return x * (F.relu6(x + 3.0) / 6.0)


def _softmax(layer: Softmax, node: Node, channels_first: bool) -> NodeModule:
    return _Unary(partial(F.softmax, dim=1 if channels_first else -1))  # the features


def _rescale(layer: Rescale, node: Node, channels_first: bool) -> NodeModule:
    scale, offset = layer.scale, layer.offset
    if isinstance(scale, tuple) or isinstance(offset, tuple):
        return PerChannelRescaleNode(layer, channels_first)
    return _Unary(lambda x: x * scale + offset)


class PerChannelRescaleNode(NodeModule):
    """``x * scale + offset`` with vectors over the channels (axis 1 of an NCHW image), cast
    to the input's dtype first, as Keras's Rescaling casts them to its compute dtype."""

    scale: torch.Tensor
    offset: torch.Tensor

    def __init__(self, layer: Rescale, channels_first: bool) -> None:
        super().__init__()
        shape = (-1, 1, 1) if channels_first else (-1,)
        for name in ("scale", "offset"):
            value = torch.as_tensor(getattr(layer, name), dtype=torch.float32)
            self.register_buffer(name, value.reshape(shape) if value.dim() else value, persistent=False)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        return x * self.scale.to(x.dtype) + self.offset.to(x.dtype)


class MultiplyNode(NodeModule):
    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        product = inputs[0]
        for other in inputs[1:]:  # left to right, as every backend multiplies
            product = product * other
        return product


def _reshape(layer: Reshape, node: Node, channels_first: bool) -> NodeModule:
    shape = node.output_shape
    return _Unary(lambda x: x.reshape(x.shape[0], *shape))  # the neutral (row-major NHWC) order


def _transpose(layer: Transpose, node: Node, channels_first: bool) -> NodeModule:
    order = (0, *(axis + 1 for axis in layer.perm))
    return _Unary(lambda x: x.permute(order))


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


class LayerNormNode(NodeModule):
    def __init__(self, layer: LayerNorm, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(node.input_shape[-1], eps=layer.eps)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.norm(inputs[0])  # type: ignore[no-any-return]


class BatchNormNode(NodeModule):
    """Batch statistics over the real rows of the whole micro-batch on every process
    (an all-reduce of the sums: SyncBatchNorm is CUDA-only and counts padding rows), the
    running statistics as buffers. The features are the last axis, or axis 1 of an NCHW
    image (``channels_first``).

    Where every row is real and one process trains (``context.weight`` None), this is
    torch's own batch norm, the same statistics and gradient in fewer, fused kernels.
    Otherwise (padding rows, several processes) the statistics come from one pass over x
    (each row's mean and variance, combined over the rows by their weights: Chan's formula,
    as stable as two passes), accumulated in the weights' dtype (float32 under autocast, or
    float64) while x is read in its own; the output is x's dtype, and the backward is batch
    norm's closed form (:class:`_MaskedBatchNorm`), not autograd's many passes through the formula."""

    def __init__(self, layer: BatchNorm, node: Node, channels_first: bool) -> None:
        super().__init__()
        features = node.input_shape[-1]
        rank = len(node.input_shape) + 1
        channel = 1 if channels_first else rank - 1
        self.momentum, self.epsilon = layer.momentum, layer.epsilon
        #: the axes statistics reduce, and those within one row
        self.axes = tuple(axis for axis in range(rank) if axis != channel)
        self.row_axes = self.axes[1:]
        #: how a per-feature vector broadcasts over x
        self.per_feature = (features, *[1] * (rank - 1 - channel))
        #: values per feature in one row (its positions: height x width for an image)
        self.positions = math.prod(node.input_shape[:-1])
        #: torch's own batch norm reads the features on axis 1
        self.native = channel == 1
        # absent under Keras's scale=False / center=False
        self.scale = nn.Parameter(torch.ones(features)) if layer.scale else None
        self.offset = nn.Parameter(torch.zeros(features)) if layer.center else None
        self.moving_mean: torch.Tensor
        self.moving_variance: torch.Tensor
        self.register_buffer("moving_mean", torch.zeros(features))
        self.register_buffer("moving_variance", torch.ones(features))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        if not self.training:
            inverse = torch.rsqrt(self.moving_variance + self.epsilon)
            y = _normalise(x, self.moving_mean, inverse, self.scale, self.offset, self.per_feature)
            return y.to(x.dtype)
        # (torch's needs two values of each feature; a one-row batch of vectors has one)
        if context.weight is None and not context.distributed and self.native and x[:, 0].numel() > 1:
            # every row real, one process: torch's own batch norm is this one's statistics
            # and gradient (its running variance unbiased too), in fewer, fused kernels
            return F.batch_norm(
                x, self.moving_mean, self.moving_variance, self.scale, self.offset,
                True, 1 - self.momentum, self.epsilon,
            )  # fmt: skip
        weight = (
            torch.ones(x.shape[0], dtype=self.moving_mean.dtype, device=x.device)
            if context.weight is None
            else context.weight.to(self.moving_mean.dtype)
        )
        mean, variance, count = self._batch_statistics(x.detach(), weight, context.distributed)
        self._move(mean, variance, count)
        inverse = torch.rsqrt(variance + self.epsilon)
        divisor = torch.clamp(count, min=1)
        normalised: torch.Tensor = _MaskedBatchNorm.apply(  # type: ignore[no-untyped-call]
            x,
            mean,
            inverse,
            self.scale,
            self.offset,
            weight / divisor,
            self.axes,
            self.per_feature,
            context.distributed,
        )
        return normalised

    @torch.no_grad()
    def _batch_statistics(
        self, x: torch.Tensor, weight: torch.Tensor, distributed: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mean and biased variance over the real rows of every process, and their count
        (a micro-batch of padding only, the end of an epoch under accumulation, counts 0:
        its statistics divide by 1, not 0)."""
        rows = x.to(weight.dtype)  # fused into the reduction's read under torch.compile
        if self.row_axes:
            row_variance, row_mean = torch.var_mean(rows, dim=self.row_axes, correction=0)
        else:  # [batch, features]: a row is one value per feature
            row_variance, row_mean = torch.zeros_like(rows), rows
        per_row = weight[:, None] * self.positions  # each row's share of the count
        first = torch.cat([(per_row * row_mean).sum(0), per_row.sum().reshape(1)])
        first = _all_reduced(first) if distributed else first
        count = first[-1]
        mean = first[:-1] / torch.clamp(count, min=1)
        spread = (per_row * (row_variance + (row_mean - mean) ** 2)).sum(0)
        spread = _all_reduced(spread) if distributed else spread
        return mean, spread / torch.clamp(count, min=1), count

    @torch.no_grad()
    def _move(self, mean: torch.Tensor, variance: torch.Tensor, count: torch.Tensor) -> None:
        """The running statistics, moved only by a micro-batch with real rows (no host sync:
        ``where``, which a CUDA graph captures)."""
        unbiased = variance * (count / torch.clamp(count - 1, min=1))
        moved = count > 0
        new_mean = self.momentum * self.moving_mean + (1 - self.momentum) * mean
        new_variance = self.moving_variance * self.momentum + (1 - self.momentum) * unbiased
        self.moving_mean.copy_(torch.where(moved, new_mean, self.moving_mean))
        self.moving_variance.copy_(torch.where(moved, new_variance, self.moving_variance))


def _normalise(
    x: torch.Tensor,
    mean: torch.Tensor,
    inverse: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """``(x - mean) * inverse * scale + offset`` in the statistics' dtype."""
    y = (x.to(mean.dtype) - mean.reshape(shape)) * inverse.reshape(shape)
    if scale is not None:
        y = y * scale.reshape(shape)
    if offset is not None:
        y = y + offset.reshape(shape)
    return y


class _MaskedBatchNorm(torch.autograd.Function):
    """Normalises x by statistics of its rows of weight w (the row mask over the count N,
    ``share`` = w / N), and differentiates them with respect to x in closed form. With
    x̂ = (x - mean) * inverse and g the output's gradient, summed over every position of
    every row (padding rows too: their output depends on the statistics) and, distributed,
    over every process (their losses depend on these statistics as well):

        dx = scale * inverse * (g - share * (sum(g) + x̂ * sum(g * x̂)))

    the gradient of the mean and of the variance through autograd, folded. The scale's and
    offset's gradients are this process's sum(g * x̂) and sum(g), which DDP averages."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        mean: torch.Tensor,
        inverse: torch.Tensor,
        scale: torch.Tensor | None,
        offset: torch.Tensor | None,
        share: torch.Tensor,
        axes: tuple[int, ...],
        shape: tuple[int, ...],
        distributed: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, mean, inverse, scale, share)
        ctx.axes, ctx.shape, ctx.distributed = axes, shape, distributed
        return _normalise(x, mean, inverse, scale, offset, shape).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, inverse, scale, share = ctx.saved_tensors
        shape = ctx.shape
        g = grad.to(mean.dtype)
        normed = (x.to(mean.dtype) - mean.reshape(shape)) * inverse.reshape(shape)
        grad_offset = g.sum(ctx.axes)
        grad_scale = (g * normed).sum(ctx.axes)
        sums = torch.cat([grad_offset, grad_scale])
        total, total_normed = (_all_reduced(sums) if ctx.distributed else sums).chunk(2)
        gain = inverse if scale is None else inverse * scale
        row_share = share.reshape(-1, *[1] * (x.dim() - 1))
        centred = row_share * (total.reshape(shape) + normed * total_normed.reshape(shape))
        grad_x = (gain.reshape(shape) * (g - centred)).to(x.dtype)
        return (
            grad_x,
            None,
            None,
            grad_scale if scale is not None else None,
            grad_offset if ctx.needs_input_grad[4] else None,
            None,
            None,
            None,
            None,
        )


def _all_reduced(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over processes (a copy: the input is left as it is)."""
    import torch.distributed as dist

    total = tensor.clone()
    dist.all_reduce(total)
    return total


class DropoutNode(NodeModule):
    """Masks from crosstrain's counter-based hash, in torch's int64 ops (see core.dropout).
    The hash numbers a row's units in the neutral (NHWC) order; on an NCHW image
    (``channels_first``) the mask is drawn in NCHW order from those same numbers."""

    def __init__(self, layer: Dropout, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.rate, self.layer_index = layer.rate, node.index
        self.features = layer.mask_units(node.input_shape)
        self.per_row = layer.per_row
        self.channels_first = channels_first and not layer.per_row  # one unit a row has no order
        self.neutral_shape = node.input_shape

    # eager under torch.compile, as keep_mask is (below): traced, the frame would be guarded
    # on this node's layer number and recompiled for each dropout node, past dynamo's limit
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        if not self.training or self.rate == 0.0:
            return x
        assert context.rows is not None, "dropout trains on row positions"
        units = None
        if self.channels_first:  # unit c, h, w of the NCHW row is unit h, w, c of the neutral
            numbers = torch.arange(self.features, device=x.device).reshape(self.neutral_shape)
            units = numbers.permute(2, 0, 1).reshape(-1)
        keep: torch.Tensor = keep_mask(
            context.seed, context.step, self.layer_index, context.rows, self.features, self.rate, units
        )
        shape = (x.shape[0],) + (1,) * (x.dim() - 1) if self.per_row else x.shape
        return (x * keep.reshape(shape).to(x.dtype)) * (1.0 / (1.0 - self.rate))


def _mix(value: Any) -> Any:
    """One round of the hash, on an int64 tensor or a Python int below 2**32."""
    first, second = neutral_dropout.MULTIPLIERS
    value = value ^ (value >> 16)
    value = (value * first) & neutral_dropout.MASK32
    value = value ^ (value >> 15)
    value = (value * second) & neutral_dropout.MASK32
    return value ^ (value >> 16)


# Eager even under torch.compile: inductor's C++ code generation promotes these int64 hash
# steps to float on CPU (torch 2.13, "invalid operands of types 'float' and 'float' to
# binary 'operator^'"); a graph break around one small mask keeps the bits the reference's.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def keep_mask(
    seed: int,
    step: int | torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    features: int,
    rate: float,
    units: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [rows, features], equal bit for bit to :func:`crosstrain.core.dropout.keep_mask`;
    ``units`` (int64 [features]) puts column j at the reference's column ``units[j]``."""
    mask32 = neutral_dropout.MASK32
    device = rows.device
    # the row-independent part on the host, in Python ints: the same low 32 bits as int64
    # ops give, and no scalar copied to the device (which would wait for its stream) per layer;
    # a CUDA graph's replay passes its step counter, and the same ops run on the device
    state = _mix(seed & mask32)
    state = _mix(state ^ (step & mask32))
    state = _mix(state ^ (layer & mask32))
    per_row = _mix(state ^ (rows.to(torch.int64)[:, None] & mask32))
    if units is None:
        units = torch.arange(features, dtype=torch.int64, device=device)
    hashed: torch.Tensor = _mix(per_row ^ units[None, :])
    return (hashed >> (32 - neutral_dropout.KEEP_BITS)) >= neutral_dropout.threshold(rate)


class EmbeddingNode(NodeModule):
    def __init__(self, layer: Embedding, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(layer.vocab_size, layer.units)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.table(inputs[0].long())  # type: ignore[no-any-return]


class PositionEmbeddingNode(NodeModule):
    def __init__(self, layer: PositionEmbedding, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(*node.input_shape))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0] + self.table


class AttentionNode(NodeModule):
    """Multi-head self-attention with torch's scaled_dot_product_attention (softmax in fp32
    for fp32 inputs; the fused kernels accumulate low-precision inputs in fp32). Grouped
    keys and values are repeated to every query head of their group; rotary embedding turns
    queries and keys by core's tables; a padding mask (the second input) adds -1e9 to the
    scores of padded keys."""

    def __init__(self, layer: Attention, node: Node, channels_first: bool) -> None:
        super().__init__()
        length, units = node.input_shape
        self.heads, self.causal = layer.heads, layer.causal
        self.head_units = units // layer.heads
        self.groups = layer.heads // layer.key_heads
        key_units = self.head_units * layer.key_heads
        bias = layer.use_bias
        self.query, self.output = (nn.Linear(units, units, bias=bias) for _ in range(2))
        self.key, self.value = (nn.Linear(units, key_units, bias=bias) for _ in range(2))
        self.rotary = layer.rotary
        cos, sin = rotary_tables(length, self.head_units, layer.rotary_base)
        # constants of the plan, not weights: kept out of the state dict
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        batch, length, units = x.shape

        def split(projection: nn.Linear) -> torch.Tensor:
            projected: torch.Tensor = projection(x)
            return projected.reshape(batch, length, -1, self.head_units).transpose(1, 2)

        query, key, value = split(self.query), split(self.key), split(self.value)
        if self.rotary:
            query, key = self._rotate(query), self._rotate(key)
        if self.groups > 1:  # key/value head j serves query heads j*groups .. j*groups+groups-1
            key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        if len(inputs) == 1:
            attended = F.scaled_dot_product_attention(query, key, value, is_causal=self.causal)
        else:
            mask = self._score_bias(inputs[1], length, query.dtype)
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return self.output(attended.transpose(1, 2).reshape(batch, length, units))  # type: ignore[no-any-return]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, heads, length, head units] turned by the rotary tables (half-split)."""
        half = self.head_units // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos.to(x.dtype) + turned * self.sin.to(x.dtype)

    def _score_bias(self, padding: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """What SDPA adds to the scores [batch, 1, query, key]: -1e9 for a padded key, and
        -inf for a later one when causal (SDPA takes a mask or is_causal, not both)."""
        bias = ((padding.to(dtype) - 1) * 1e9)[:, None, None, :]
        if self.causal:
            later = torch.ones(length, length, dtype=torch.bool, device=padding.device).triu(1)
            bias = bias.masked_fill(later, -math.inf)
        return bias


class RMSNormNode(NodeModule):
    """docs/layers.md's RMS norm of the last axis, in the weights' dtype (fp32 under bf16 and
    fp16, as batch norm)."""

    def __init__(self, layer: RMSNorm, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.epsilon = layer.epsilon
        self.scale = nn.Parameter(torch.ones(node.input_shape[-1]))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0].to(self.scale.dtype)  # the weights' dtype: float32 under autocast, or float64
        normed = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.epsilon)
        return (normed * self.scale).to(inputs[0].dtype)


class ClassTokenNode(NodeModule):
    def __init__(self, layer: ClassToken, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, node.input_shape[-1]))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        return torch.cat([self.token.to(x.dtype).expand(x.shape[0], 1, x.shape[2]), x], dim=1)


class TakeNode(NodeModule):
    """Reads the neutral order (``Order.NEUTRAL``): the row's first axis is its first."""

    def __init__(self, layer: Take, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.index = layer.index

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0][:, self.index]


class _BiasOnly(nn.Module):
    """A tied dense's own parameter: its bias, or none."""

    def __init__(self, units: int, use_bias: bool) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(units)) if use_bias else None


class TiedDenseNode(NodeModule):
    """A dense whose kernel is an embedding's table, transposed (``tie``): the graph module
    hands it that embedding's node (:meth:`tie`), read at each forward; its own parameter is
    the bias alone, under the untied dense's name (``linear.bias``)."""

    def __init__(self, layer: Dense, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.linear = _BiasOnly(layer.units, layer.use_bias)
        # a list, so that the embedding is not registered twice (its table stays one
        # parameter of the model, under the embedding's name)
        self.tied: list[EmbeddingNode] = []

    def tie(self, embedding: NodeModule) -> None:
        assert isinstance(embedding, EmbeddingNode), "a dense ties to an embedding"
        self.tied[:] = [embedding]

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        # the table [vocab, units] is nn.Linear's weight layout [out, in] already
        return F.linear(inputs[0], self.tied[0].table.weight, self.linear.bias)


def _dense_node(layer: Dense, node: Node, channels_first: bool) -> NodeModule:
    return (
        DenseNode(layer, node, channels_first)
        if node.tied_to is None
        else TiedDenseNode(layer, node, channels_first)
    )


def _padding_mask(layer: PaddingMask) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: (ids != layer.pad_id).float()


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
    return lambda layer, node, channels_first: _Unary(function)


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

#: core layer type -> how it runs here, one row each; core's graph resolves blocks, so
#: Block has no row. The keys are the backend's vocabulary of layers.
LAYERS: dict[type[Layer], NodeSpec[Any]] = {
    Dense: NodeSpec(_dense_node, Order.NEUTRAL, _DENSE),  # on the last axis; tied: no kernel of its own
    Conv2D: NodeSpec(
        ConvNode, Order.CHANNELS_FIRST, {"kernel": ("conv.weight", (3, 2, 0, 1)), "bias": ("conv.bias", None)}
    ),
    MaxPool2D: NodeSpec(PoolNode, Order.CHANNELS_FIRST),
    AvgPool2D: NodeSpec(PoolNode, Order.CHANNELS_FIRST),
    GlobalAvgPool2D: NodeSpec(GlobalPoolNode, Order.REDUCES),
    Flatten: NodeSpec(_unary(_flatten), Order.NEUTRAL),  # the neutral order of the elements is its output
    Conv1D: NodeSpec(  # a sequence, not an image
        Conv1DNode, Order.NEUTRAL, {"kernel": ("conv.weight", (2, 1, 0)), "bias": ("conv.bias", None)}
    ),
    Conv2DTranspose: NodeSpec(  # [kh, kw, out, in] -> torch's [in, out, kh, kw]
        ConvTransposeNode,
        Order.CHANNELS_FIRST,
        {"kernel": ("conv.weight", (3, 2, 0, 1)), "bias": ("conv.bias", None)},
    ),
    UpSample2D: NodeSpec(UpSampleNode, Order.CHANNELS_FIRST),
    ZeroPad2D: NodeSpec(_zero_pad, Order.CHANNELS_FIRST),
    Crop2D: NodeSpec(_crop, Order.CHANNELS_FIRST),
    LayerScale: NodeSpec(LayerScaleNode, Order.NEUTRAL, {"scale": ("scale", None)}),  # on the last axis
    Sigmoid: NodeSpec(_unary(torch.sigmoid), Order.EITHER),
    SiLU: NodeSpec(_unary(F.silu), Order.EITHER),
    Softmax: NodeSpec(_softmax, Order.EITHER),  # over the channel axis of either order
    ReLU6: NodeSpec(_unary(F.relu6), Order.EITHER),  # gradient 0 at 0 and 6, as tf's
    HardSwish: NodeSpec(_unary(_hard_swish), Order.EITHER),
    Multiply: NodeSpec(lambda layer, node, channels_first: MultiplyNode(), Order.EITHER),
    Reshape: NodeSpec(_reshape, Order.NEUTRAL),
    Transpose: NodeSpec(_transpose, Order.NEUTRAL),
    Mean: NodeSpec(MeanNode, Order.EITHER),
    Rescale: NodeSpec(_rescale, Order.EITHER),
    ReLU: NodeSpec(_unary(F.relu), Order.EITHER),
    LeakyReLU: NodeSpec(
        lambda layer, node, first: _Unary(partial(F.leaky_relu, negative_slope=layer.negative_slope)),
        Order.EITHER,
    ),
    GELU: NodeSpec(_unary(F.gelu), Order.EITHER),  # erf, torch's default
    Tanh: NodeSpec(_unary(torch.tanh), Order.EITHER),
    Dropout: NodeSpec(DropoutNode, Order.EITHER),  # draws its mask in the input's order
    LayerNorm: NodeSpec(
        LayerNormNode, Order.NEUTRAL, {"scale": ("norm.weight", None), "offset": ("norm.bias", None)}
    ),  # on the last axis
    BatchNorm: NodeSpec(  # on the channel axis of either order
        BatchNormNode,
        Order.EITHER,
        {name: (name, None) for name in ("scale", "offset", "moving_mean", "moving_variance")},
    ),
    Embedding: NodeSpec(  # token ids are never an image
        EmbeddingNode,
        Order.NEUTRAL,
        {"table": ("table.weight", None)},
        uncapturable="an embedding's backward syncs with the host (pytorch#82886)",
    ),
    PositionEmbedding: NodeSpec(PositionEmbeddingNode, Order.NEUTRAL, {"table": ("table", None)}),
    Attention: NodeSpec(AttentionNode, Order.NEUTRAL, _ATTENTION),
    RMSNorm: NodeSpec(RMSNormNode, Order.NEUTRAL, {"scale": ("scale", None)}),  # on the last axis
    ClassToken: NodeSpec(ClassTokenNode, Order.NEUTRAL, {"token": ("token", None)}),
    Take: NodeSpec(TakeNode, Order.NEUTRAL),
    PaddingMask: NodeSpec(lambda layer, node, first: _Unary(_padding_mask(layer)), Order.NEUTRAL),
    Add: NodeSpec(lambda layer, node, channels_first: AddNode(), Order.EITHER),
    Concat: NodeSpec(ConcatNode, Order.EITHER),  # on the channel axis of either order
}
