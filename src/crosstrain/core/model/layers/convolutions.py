"""Convolutions (1-D, 2-D, transposed), pooling, upsampling and padding of images: the
layers that slide a window over positions. Images are channels-last, ``[height, width,
channels]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

from crosstrain.core.model.layers.activations import known_activation
from crosstrain.core.model.layers.base import (
    Layer,
    Pair,
    Shape,
    WeightSpec,
    as_pair,
    expect_image,
    expect_rank,
    glorot,
    positive,
)

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "AvgPool2D",
    "Conv1D",
    "Conv2D",
    "Conv2DTranspose",
    "Crop2D",
    "GlobalAvgPool2D",
    "MaxPool2D",
    "UpSample2D",
    "ZeroPad2D",
]


def _window_output(size: int, window: int, stride: int, padding: str) -> int:
    if padding == "same":
        return math.ceil(size / stride)
    return (size - window) // stride + 1


def dilated(window: int, dilation: int) -> int:
    """The extent of a window of ``window`` taps ``dilation`` apart."""
    return (window - 1) * dilation + 1


def same_padding(size: int, window: int, stride: int) -> Pair:
    """TensorFlow's ``'same'`` padding of one axis, (before, after): the output has
    ceil(size / stride) positions, and an odd total puts its extra row or column after (at
    the bottom or right), where torch's symmetric padding cannot put it."""
    total = max((math.ceil(size / stride) - 1) * stride + window - size, 0)
    return (total // 2, total - total // 2)


def _conv_output(input_shape: Shape, kernel: Shape, windows: Shape, strides: Shape, padding: str) -> Shape:
    """The spatial output sizes of a convolution on a channels-last input; ``windows`` are
    the kernel's dilated extents."""
    sizes = input_shape[:-1]
    outputs = tuple(_window_output(*axis, padding) for axis in zip(sizes, windows, strides, strict=True))
    if any(size <= 0 for size in outputs):
        spread = f" (dilated to {_show(windows)})" if windows != kernel else ""
        raise ValueError(f"kernel {_show(kernel)}{spread} does not fit input shape {list(input_shape)}")
    return outputs


def _check_groups(channels: int, groups: int) -> None:
    if channels % groups:
        raise ValueError(f"groups = {groups} does not divide the {channels} input channels")


def _check_filters(filters: int, groups: int, strides: Shape, dilation: Shape) -> None:
    if filters % groups:
        raise ValueError(f"groups = {groups} does not divide filters = {filters}")
    # Keras's Conv layers refuse the pair too (TensorFlow's kernels have no such mode)
    if max(strides) > 1 and max(dilation) > 1:
        raise ValueError(f"strides {list(strides)} > 1 with dilation {list(dilation)} > 1 is not supported")


@attrs.frozen
class Conv2D(Layer):
    """2-D convolution on NHWC input: kernel [kh, kw, in / groups, out], bias [out].
    ``kernel_size``, ``strides`` and ``dilation`` are an int or [h, w]; ``padding = "same"``
    pads as TensorFlow does (:func:`same_padding`) at any stride; ``groups`` splits the
    input and output channels into that many convolutions side by side (depthwise when
    groups = the input channels)."""

    type: ClassVar[str] = "conv2d"
    later_fields: ClassVar[tuple[str, ...]] = ("dilation", "groups")
    filters: int = attrs.field(validator=positive)
    kernel_size: Pair = attrs.field(converter=as_pair, validator=positive)
    strides: Pair = attrs.field(default=(1, 1), converter=as_pair, validator=positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True
    dilation: Pair = attrs.field(default=(1, 1), converter=as_pair, validator=positive)
    groups: int = attrs.field(default=1, validator=positive)
    #: as dense's: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=known_activation)

    def __attrs_post_init__(self) -> None:
        _check_filters(self.filters, self.groups, self.strides, self.dilation)

    @property
    def windows(self) -> Pair:
        """The kernel's extent on the image, dilation included."""
        return (
            dilated(self.kernel_size[0], self.dilation[0]),
            dilated(self.kernel_size[1], self.dilation[1]),
        )

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        _check_groups(input_shape[-1], self.groups)
        out_h, out_w = _conv_output(input_shape, self.kernel_size, self.windows, self.strides, self.padding)
        return (out_h, out_w, self.filters)

    def paddings(self, input_shape: Shape) -> tuple[Pair, Pair]:
        """((top, bottom), (left, right)): the zeros around the image that the convolution
        reads (none for ``valid``)."""
        if self.padding == "valid":
            return ((0, 0), (0, 0))
        height, width, _ = input_shape
        return (
            same_padding(height, self.windows[0], self.strides[0]),
            same_padding(width, self.windows[1], self.strides[1]),
        )

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        per_group = input_shape[-1] // self.groups
        receptive = self.kernel_size[0] * self.kernel_size[1]
        shape = (*self.kernel_size, per_group, self.filters)
        # fans from the kernel's shape, as Keras computes them for a grouped kernel
        specs = {"kernel": glorot(shape, receptive * per_group, receptive * self.filters)}
        if self.use_bias:
            specs["bias"] = WeightSpec((self.filters,), "zeros")
        return specs

    def multiply_adds(self, input_shape: Shape) -> int:
        out_h, out_w, _ = self.output_shape(input_shape)
        receptive = self.kernel_size[0] * self.kernel_size[1]
        return out_h * out_w * receptive * (input_shape[-1] // self.groups) * self.filters


def _show(sizes: Shape) -> str:
    """A kernel's sizes as a plan writes them: one number when they are all equal."""
    return str(sizes[0]) if len(set(sizes)) == 1 else str(list(sizes))


@attrs.frozen
class _Pool2D(Layer):
    """Pooling on NHWC input; strides default to the pool size. ``padding = "same"`` pads as
    TensorFlow does (:func:`same_padding`), and a window reads only the real cells it covers:
    max ignores the padding, avg divides by the count of real cells (:meth:`real_counts`)."""

    later_fields: ClassVar[tuple[str, ...]] = ("padding",)
    pool_size: int = attrs.field(default=2, validator=positive)
    strides: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )

    @property
    def effective_strides(self) -> int:
        return self.strides if self.strides is not None else self.pool_size

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        height, width, channels = input_shape
        out_h = _window_output(height, self.pool_size, self.effective_strides, self.padding)
        out_w = _window_output(width, self.pool_size, self.effective_strides, self.padding)
        if out_h <= 0 or out_w <= 0:
            raise ValueError(f"pool {self.pool_size} does not fit input shape {list(input_shape)}")
        return (out_h, out_w, channels)

    def paddings(self, input_shape: Shape) -> tuple[Pair, Pair]:
        """((top, bottom), (left, right)) of an NHWC input: zeros for 'valid'."""
        if self.padding == "valid":
            return ((0, 0), (0, 0))
        height, width = input_shape[:2]
        return (
            same_padding(height, self.pool_size, self.effective_strides),
            same_padding(width, self.pool_size, self.effective_strides),
        )

    def real_counts(self, input_shape: Shape) -> np.ndarray:
        """float32 [out_h, out_w]: how many real (not padding) cells each window covers."""
        counts = []
        for axis, pads in enumerate(self.paddings(input_shape)):
            size, stride = input_shape[axis], self.effective_strides
            starts = np.arange(_window_output(size, self.pool_size, stride, self.padding)) * stride - pads[0]
            ends = starts + self.pool_size
            counts.append(np.minimum(ends, size) - np.maximum(starts, 0))
        return np.outer(counts[0], counts[1]).astype(np.float32)


@attrs.frozen
class MaxPool2D(_Pool2D):
    type: ClassVar[str] = "maxpool2d"


@attrs.frozen
class AvgPool2D(_Pool2D):
    type: ClassVar[str] = "avgpool2d"


@attrs.frozen
class GlobalAvgPool2D(Layer):
    """Mean over height and width: [h, w, c] -> [c]."""

    type: ClassVar[str] = "global_avg_pool2d"

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        return (input_shape[-1],)


@attrs.frozen
class Conv1D(Layer):
    """1-D convolution on [length, channels]: kernel [k, in / groups, out], bias [out].
    Fields as conv2d's, each one int; ``padding = "same"`` pads as TensorFlow does."""

    type: ClassVar[str] = "conv1d"
    filters: int = attrs.field(validator=positive)
    kernel_size: int = attrs.field(validator=positive)
    strides: int = attrs.field(default=1, validator=positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True
    dilation: int = attrs.field(default=1, validator=positive)
    groups: int = attrs.field(default=1, validator=positive)
    #: as dense's: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=known_activation)

    def __attrs_post_init__(self) -> None:
        _check_filters(self.filters, self.groups, (self.strides,), (self.dilation,))

    @property
    def window(self) -> int:
        """The kernel's extent on the sequence, dilation included."""
        return dilated(self.kernel_size, self.dilation)

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_rank(self, input_shape, 2, "a sequence [length, channels]")
        _check_groups(input_shape[-1], self.groups)
        (length,) = _conv_output(
            input_shape, (self.kernel_size,), (self.window,), (self.strides,), self.padding
        )
        return (length, self.filters)

    def paddings(self, input_shape: Shape) -> Pair:
        """(before, after): the zeros around the sequence that the convolution reads."""
        if self.padding == "valid":
            return (0, 0)
        return same_padding(input_shape[0], self.window, self.strides)

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        per_group = input_shape[-1] // self.groups
        shape = (self.kernel_size, per_group, self.filters)
        specs = {"kernel": glorot(shape, self.kernel_size * per_group, self.kernel_size * self.filters)}
        if self.use_bias:
            specs["bias"] = WeightSpec((self.filters,), "zeros")
        return specs

    def multiply_adds(self, input_shape: Shape) -> int:
        length, _ = self.output_shape(input_shape)
        return length * self.kernel_size * (input_shape[-1] // self.groups) * self.filters


def transposed_size(size: int, window: int, stride: int, padding: str) -> int:
    """Keras's output size of a transposed convolution (no output_padding): ``size *
    stride`` for ``same``, ``(size - 1) * stride + max(window, stride)`` for ``valid``."""
    if padding == "same":
        return size * stride
    return (size - 1) * stride + max(window, stride)


@attrs.frozen
class Conv2DTranspose(Layer):
    """The transpose of a conv2d (its gradient with respect to its input) on NHWC input:
    kernel [kh, kw, out, in] (Keras's layout: a conv2d kernel [kh, kw, in, out] read the
    other way), bias [out]. Each input position adds kernel x value into a window of the
    full output, (in - 1) * strides + kernel_size long per axis; the output is the part of
    it from :meth:`crops`, Keras's sizes (:func:`transposed_size`)."""

    type: ClassVar[str] = "conv2d_transpose"
    filters: int = attrs.field(validator=positive)
    kernel_size: Pair = attrs.field(converter=as_pair, validator=positive)
    strides: Pair = attrs.field(default=(1, 1), converter=as_pair, validator=positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True
    #: as dense's: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=known_activation)

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        height, width, _ = input_shape
        return (
            transposed_size(height, self.kernel_size[0], self.strides[0], self.padding),
            transposed_size(width, self.kernel_size[1], self.strides[1], self.padding),
            self.filters,
        )

    def crops(self, input_shape: Shape) -> tuple[Pair, Pair]:
        """Per axis (height, width): (first position of the full output kept, zeros added
        after its end). ``same`` keeps what a ``same`` conv2d of the output reads: it starts
        at that conv's padding before; a window shorter than the stride leaves zeros after
        the full output's end."""
        output = self.output_shape(input_shape)
        axes = []
        for axis in (0, 1):
            window, stride = self.kernel_size[axis], self.strides[axis]
            start = same_padding(output[axis], window, stride)[0] if self.padding == "same" else 0
            full = (input_shape[axis] - 1) * stride + window
            axes.append((start, max(start + output[axis] - full, 0)))
        return (axes[0], axes[1])

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        channels = input_shape[-1]
        receptive = self.kernel_size[0] * self.kernel_size[1]
        shape = (*self.kernel_size, self.filters, channels)
        specs = {"kernel": glorot(shape, receptive * self.filters, receptive * channels)}
        if self.use_bias:
            specs["bias"] = WeightSpec((self.filters,), "zeros")
        return specs

    def multiply_adds(self, input_shape: Shape) -> int:
        height, width, channels = input_shape
        return height * width * self.kernel_size[0] * self.kernel_size[1] * channels * self.filters


#: Keras's other UpSampling2D interpolations, refused with the reason (no backend could
#: match torch's numbers to the parity tolerance)
NOT_INTERPOLATIONS = {
    "bicubic": "torch's bicubic kernel (a = -0.75) is not tf.image.resize's (Keys, a = -0.5)",
    "lanczos3": "torch has no Lanczos resampling",
    "lanczos5": "torch has no Lanczos resampling",
}


def _known_interpolation(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value in ("nearest", "bilinear"):
        return
    reason = NOT_INTERPOLATIONS.get(value)
    tail = f": {reason}" if reason else ""
    raise ValueError(f"'{attribute.name}' must be one of 'nearest', 'bilinear', got {value!r}{tail}")


@attrs.frozen
class UpSample2D(Layer):
    """Keras's UpSampling2D on NHWC input: each axis ``size`` times longer. ``nearest``
    repeats each row and column; ``bilinear`` samples at half-pixel centres (output
    position o reads input position (o + 0.5) / size - 0.5, clamped at 0), as
    tf.image.resize and torch's ``align_corners=False``."""

    type: ClassVar[str] = "upsample2d"
    size: Pair = attrs.field(default=(2, 2), converter=as_pair, validator=positive)
    interpolation: str = attrs.field(default="nearest", validator=_known_interpolation)

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        height, width, channels = input_shape
        return (height * self.size[0], width * self.size[1], channels)


def as_padding2d(value: int | Sequence[int] | Sequence[Sequence[int]]) -> tuple[Pair, Pair]:
    """Keras's ZeroPadding2D ``padding``: an int (every side), [h, w] (top and bottom h,
    left and right w) or [[top, bottom], [left, right]]."""
    if isinstance(value, int):
        return ((value, value), (value, value))
    items: list[int | Sequence[int]] = list(value)
    if len(items) == 2:
        height, width = items
        if isinstance(height, int) and isinstance(width, int):
            return ((height, height), (width, width))
        if not isinstance(height, int) and not isinstance(width, int):
            return (as_pair(height), as_pair(width))
    raise ValueError(f"expected an int, [h, w] or [[top, bottom], [left, right]], got {items}")


def _not_negative_padding(
    instance: object, attribute: attrs.Attribute[Any], value: tuple[Pair, Pair]
) -> None:
    if any(side < 0 for pair in value for side in pair):
        raise ValueError(f"'{attribute.name}' must be >= 0, got {[list(pair) for pair in value]}")


@attrs.frozen
class ZeroPad2D(Layer):
    """Keras's ZeroPadding2D: zero rows above and below, zero columns left and right of an
    NHWC image; ``padding`` is an int, [h, w] or [[top, bottom], [left, right]]."""

    type: ClassVar[str] = "zero_pad2d"
    padding: tuple[Pair, Pair] = attrs.field(
        default=((1, 1), (1, 1)), converter=as_padding2d, validator=_not_negative_padding
    )

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        height, width, channels = input_shape
        (top, bottom), (left, right) = self.padding
        return (height + top + bottom, width + left + right, channels)


@attrs.frozen
class Crop2D(Layer):
    """Keras's Cropping2D: rows removed above and below, columns left and right of an NHWC
    image (NASNet aligns its two branches with it); ``cropping`` is an int, [h, w] or
    [[top, bottom], [left, right]], as zero_pad2d's ``padding``."""

    type: ClassVar[str] = "crop2d"
    cropping: tuple[Pair, Pair] = attrs.field(
        default=((1, 1), (1, 1)), converter=as_padding2d, validator=_not_negative_padding
    )

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_image(self, input_shape)
        height, width, channels = input_shape
        (top, bottom), (left, right) = self.cropping
        if top + bottom >= height or left + right >= width:
            raise ValueError(
                f"cropping {[list(pair) for pair in self.cropping]} leaves nothing of input shape "
                f"{list(input_shape)}"
            )
        return (height - top - bottom, width - left - right, channels)
