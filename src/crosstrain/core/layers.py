"""The neutral layer vocabulary: shapes are channels-last, weights are numpy.

Each layer knows its output shape (so a plan is checked end to end before any process
starts), the shapes of its weights and how each starts (Glorot-uniform kernels, zero
biases, unit scales, small normal embeddings), and its multiply-add count for
``crosstrain describe``. Every backend receives exactly the arrays made here (numpy,
channels-last, seeded). How layers connect (names, ``inputs``, blocks) lives in
:mod:`crosstrain.core.graph`.

Shapes here are one row's: the batch axis is never part of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

from crosstrain.core.errors import closest_name

Shape = tuple[int, ...]
Weights = dict[str, np.ndarray]
Pair = tuple[int, int]
DType = Literal["float32", "int32"]


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    values = value if isinstance(value, tuple) else (value,)
    if any(item <= 0 for item in values):
        raise ValueError(f"'{attribute.name}' must be > 0, got {list(values) if len(values) > 1 else value}")


def _not_negative(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise ValueError(f"'{attribute.name}' must be >= 0, got {value}")


def _known_activation(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """``activation`` is a name of :data:`ACTIVATIONS` (defined below, beside the layers it
    adds); a name Keras knows that would compute something else here says why not."""
    if value is None or value in ACTIVATIONS:
        return
    reason = NOT_ACTIVATIONS.get(value)
    match = closest_name(value, ACTIVATIONS)
    tail = f": {reason}" if reason else f"; did you mean {match!r}?" if match else ""
    raise ValueError(
        f"'{attribute.name}' must be one of {', '.join(sorted(ACTIVATIONS))}, got {value!r}{tail}"
    )


def as_pair(value: int | Sequence[int]) -> Pair:
    """An int or [h, w] as (h, w): the kernel_size/strides convention of both frameworks."""
    if isinstance(value, int):
        return (value, value)
    items = tuple(value)
    if len(items) != 2:
        raise ValueError(f"expected an int or [height, width], got {list(items)}")
    return (int(items[0]), int(items[1]))


@attrs.frozen
class WeightSpec:
    """One weight of a layer: its shape, how it starts, and whether the optimizer trains it
    (batch norm's running statistics are weights too, updated by the forward pass)."""

    shape: Shape
    init: Literal["glorot", "zeros", "ones", "normal"]
    fan_in: int = 0
    fan_out: int = 0
    stddev: float = 0.02
    trainable: bool = True
    #: a matrix or convolution kernel: what ``optimizer.decay = "kernels"`` decays (biases,
    #: norm scales and offsets, embedding and position tables are not kernels)
    kernel: bool = False

    def initial(self, rng: np.random.Generator) -> np.ndarray:
        if self.init == "glorot":
            limit = math.sqrt(6.0 / (self.fan_in + self.fan_out))
            return rng.uniform(-limit, limit, size=self.shape).astype(np.float32)
        if self.init == "normal":
            return (rng.standard_normal(size=self.shape) * self.stddev).astype(np.float32)
        if self.init == "ones":
            return np.ones(self.shape, np.float32)
        return np.zeros(self.shape, np.float32)


def _glorot(shape: Shape, fan_in: int, fan_out: int) -> WeightSpec:
    return WeightSpec(shape, "glorot", fan_in=fan_in, fan_out=fan_out, kernel=True)


@attrs.frozen
class Layer:
    """Base of every neutral layer. ``type`` is the plan's tag; ``name`` (unique within its
    list) and ``inputs`` (names of earlier layers of the same list, or ``"input"``) are
    optional: without ``inputs`` a layer takes the previous layer's output."""

    type: ClassVar[str] = ""
    #: how many inputs the layer takes: 1, or None for two or more (add, concat)
    arity: ClassVar[int | None] = 1
    #: what the inputs a layer may take after its ``arity`` ones are, in order (attention's
    #: padding mask)
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    #: which input dtypes it accepts; only an embedding reads integer token ids
    accepts: ClassVar[tuple[DType, ...]] = ("float32",)
    #: fields added after plans of this type were first written: left out of plan.json at
    #: their default, so an older run's plan hashes as before and still resumes
    later_fields: ClassVar[tuple[str, ...]] = ()
    name: str | None = attrs.field(default=None, kw_only=True)
    inputs: tuple[str, ...] | None = attrs.field(default=None, kw_only=True)

    def output_shape(self, input_shape: Shape) -> Shape:
        return input_shape

    def merged_shape(self, input_shapes: Sequence[Shape]) -> Shape:
        """The output shape from every input's shape (one, unless ``arity`` is None)."""
        return self.output_shape(input_shapes[0])

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {}

    def multiply_adds(self, input_shape: Shape) -> int:
        """Multiply-adds of the forward pass for one row (elementwise work not counted)."""
        return 0


def _expect_rank(layer: Layer, input_shape: Shape, rank: int, what: str) -> None:
    if len(input_shape) != rank:
        raise ValueError(f"{layer.type} expects {what}, got input shape {list(input_shape)}")


def _expect_image(layer: Layer, input_shape: Shape) -> None:
    _expect_rank(layer, input_shape, 3, "an image input [height, width, channels]")


# --------------------------------------------------------------------------- dense and conv


@attrs.frozen
class Dense(Layer):
    """Fully connected on the last axis, as in Keras: kernel [in, out], bias [out]."""

    type: ClassVar[str] = "dense"
    later_fields: ClassVar[tuple[str, ...]] = ("tie",)
    units: int = attrs.field(validator=_positive)
    use_bias: bool = True
    #: Keras's ``activation="relu"``: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=_known_activation)
    #: weight tying (GPT-2, Llama's output): the name of an earlier embedding layer of the same
    #: list, whose table [vocab_size, units] transposed is this layer's kernel; the layer then
    #: has no kernel of its own (the graph checks the shapes: crosstrain.core.graph)
    tie: str | None = attrs.field(default=None, kw_only=True)

    def output_shape(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise ValueError("dense needs at least one feature axis")
        return (*input_shape[:-1], self.units)

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        fan_in = input_shape[-1]
        specs: dict[str, WeightSpec] = {}
        if self.tie is None:
            specs["kernel"] = _glorot((fan_in, self.units), fan_in, self.units)
        if self.use_bias:
            specs["bias"] = WeightSpec((self.units,), "zeros")
        return specs

    def multiply_adds(self, input_shape: Shape) -> int:
        return math.prod(input_shape) * self.units


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
    filters: int = attrs.field(validator=_positive)
    kernel_size: Pair = attrs.field(converter=as_pair, validator=_positive)
    strides: Pair = attrs.field(default=(1, 1), converter=as_pair, validator=_positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True
    dilation: Pair = attrs.field(default=(1, 1), converter=as_pair, validator=_positive)
    groups: int = attrs.field(default=1, validator=_positive)
    #: as dense's: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=_known_activation)

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
        _expect_image(self, input_shape)
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
        specs = {"kernel": _glorot(shape, receptive * per_group, receptive * self.filters)}
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


# --------------------------------------------------------------------------- pooling and reshaping


@attrs.frozen
class _Pool2D(Layer):
    """Pooling on NHWC input; strides default to the pool size. ``padding = "same"`` pads as
    TensorFlow does (:func:`same_padding`), and a window reads only the real cells it covers:
    max ignores the padding, avg divides by the count of real cells (:meth:`real_counts`)."""

    later_fields: ClassVar[tuple[str, ...]] = ("padding",)
    pool_size: int = attrs.field(default=2, validator=_positive)
    strides: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )

    @property
    def effective_strides(self) -> int:
        return self.strides if self.strides is not None else self.pool_size

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_image(self, input_shape)
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
        _expect_image(self, input_shape)
        return (input_shape[-1],)


@attrs.frozen
class Flatten(Layer):
    """Flattens in channels-last (NHWC) order; torch must permute before flattening."""

    type: ClassVar[str] = "flatten"

    def output_shape(self, input_shape: Shape) -> Shape:
        return (math.prod(input_shape),)


# --------------------------------------------------------------------------- vision and shapes


@attrs.frozen
class Conv1D(Layer):
    """1-D convolution on [length, channels]: kernel [k, in / groups, out], bias [out].
    Fields as conv2d's, each one int; ``padding = "same"`` pads as TensorFlow does."""

    type: ClassVar[str] = "conv1d"
    filters: int = attrs.field(validator=_positive)
    kernel_size: int = attrs.field(validator=_positive)
    strides: int = attrs.field(default=1, validator=_positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True
    dilation: int = attrs.field(default=1, validator=_positive)
    groups: int = attrs.field(default=1, validator=_positive)
    #: as dense's: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=_known_activation)

    def __attrs_post_init__(self) -> None:
        _check_filters(self.filters, self.groups, (self.strides,), (self.dilation,))

    @property
    def window(self) -> int:
        """The kernel's extent on the sequence, dilation included."""
        return dilated(self.kernel_size, self.dilation)

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 2, "a sequence [length, channels]")
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
        specs = {"kernel": _glorot(shape, self.kernel_size * per_group, self.kernel_size * self.filters)}
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
    filters: int = attrs.field(validator=_positive)
    kernel_size: Pair = attrs.field(converter=as_pair, validator=_positive)
    strides: Pair = attrs.field(default=(1, 1), converter=as_pair, validator=_positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True
    #: as dense's: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=_known_activation)

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_image(self, input_shape)
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
        specs = {"kernel": _glorot(shape, receptive * self.filters, receptive * channels)}
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
    size: Pair = attrs.field(default=(2, 2), converter=as_pair, validator=_positive)
    interpolation: str = attrs.field(default="nearest", validator=_known_interpolation)

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_image(self, input_shape)
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


def as_sizes(value: Sequence[int]) -> tuple[int, ...]:
    """A list of ints (axes, sizes) as a tuple."""
    return tuple(value)


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
        _expect_image(self, input_shape)
        height, width, channels = input_shape
        (top, bottom), (left, right) = self.padding
        return (height + top + bottom, width + left + right, channels)


@attrs.frozen
class Sigmoid(Layer):
    type: ClassVar[str] = "sigmoid"


@attrs.frozen
class SiLU(Layer):
    """``x * sigmoid(x)`` (Keras's silu and swish)."""

    type: ClassVar[str] = "silu"


@attrs.frozen
class Softmax(Layer):
    """Softmax over the last axis (the channels of an image)."""

    type: ClassVar[str] = "softmax"


@attrs.frozen
class ReLU6(Layer):
    """``min(max(x, 0), 6)``; its gradient is 0 at 0 and at 6."""

    type: ClassVar[str] = "relu6"


@attrs.frozen
class HardSwish(Layer):
    """Keras's hard_silu (hard_swish): ``x * (relu6(x + 3) / 6)``, differentiated as that
    expression (relu6's gradient 0 at 0 and 6), so at x = -3 and 3 as Keras, not torch's
    F.hardswish."""

    type: ClassVar[str] = "hard_swish"


@attrs.frozen
class Multiply(Layer):
    """The element-wise product of two or more inputs, left to right: a gate (squeeze and
    excite, SwiGLU). Inputs have one rank; on each axis their sizes agree or are 1, which
    broadcasts (a [1, 1, channels] gate over an image)."""

    type: ClassVar[str] = "multiply"
    arity: ClassVar[int | None] = None

    def merged_shape(self, input_shapes: Sequence[Shape]) -> Shape:
        _expect_inputs(self, input_shapes)
        shapes = [list(shape) for shape in input_shapes]
        if len({len(shape) for shape in input_shapes}) != 1:
            raise ValueError(f"multiply needs inputs of one rank, got {shapes}")
        merged = []
        for sizes in zip(*input_shapes, strict=True):
            wide = {size for size in sizes if size != 1}
            if len(wide) > 1:
                raise ValueError(f"multiply needs sizes that agree or are 1 on each axis, got {shapes}")
            merged.append(wide.pop() if wide else 1)
        return tuple(merged)


def _target_shape(instance: object, attribute: attrs.Attribute[Any], value: Shape) -> None:
    if not value or any(size <= 0 and size != -1 for size in value) or value.count(-1) > 1:
        raise ValueError(f"'{attribute.name}' must be sizes > 0 and at most one -1, got {list(value)}")


@attrs.frozen
class Reshape(Layer):
    """Each row to ``target_shape`` (one size may be -1: what the row's values leave), in
    the row's channels-last (row-major) order of values."""

    type: ClassVar[str] = "reshape"
    target_shape: tuple[int, ...] = attrs.field(converter=as_sizes, validator=_target_shape)

    def output_shape(self, input_shape: Shape) -> Shape:
        values = math.prod(input_shape)
        known = math.prod(size for size in self.target_shape if size != -1)
        inferred = values // known if -1 in self.target_shape else values
        shape = tuple(inferred if size == -1 else size for size in self.target_shape)
        if math.prod(shape) != values:
            raise ValueError(
                f"reshape cannot make {list(self.target_shape)} of input shape {list(input_shape)}"
            )
        return shape


@attrs.frozen
class Transpose(Layer):
    """Reorders a row's axes: output axis i is input axis ``perm[i]`` (the batch axis is
    not counted: ``perm = [1, 0]`` swaps a sequence's length and features)."""

    type: ClassVar[str] = "transpose"
    perm: tuple[int, ...] = attrs.field(converter=as_sizes)

    def output_shape(self, input_shape: Shape) -> Shape:
        if sorted(self.perm) != list(range(len(input_shape))):
            raise ValueError(
                f"perm {list(self.perm)} is not an order of the axes of input shape {list(input_shape)}"
            )
        return tuple(input_shape[axis] for axis in self.perm)


@attrs.frozen
class Mean(Layer):
    """The mean over a row's ``axes`` (0 is the first axis after the batch; -1 the last),
    which ``keepdims`` keeps as size 1: ``axes = [0, 1], keepdims = true`` on an image is
    the [1, 1, channels] mean of a squeeze-and-excite gate."""

    type: ClassVar[str] = "mean"
    axes: tuple[int, ...] = attrs.field(converter=as_sizes)
    keepdims: bool = False

    @axes.validator
    def _check_axes(self, attribute: attrs.Attribute[Shape], value: Shape) -> None:
        if not value:
            raise ValueError("'axes' must name at least one axis")

    def resolved_axes(self, rank: int) -> Shape:
        """The axes counted from 0, in increasing order."""
        return tuple(sorted(axis % rank for axis in self.axes))

    def output_shape(self, input_shape: Shape) -> Shape:
        rank = len(input_shape)
        if any(not -rank <= axis < rank for axis in self.axes) or len(set(self.resolved_axes(rank))) != len(
            self.axes
        ):
            raise ValueError(
                f"axes {list(self.axes)} are not distinct axes of input shape {list(input_shape)}"
            )
        axes = self.resolved_axes(rank)
        if self.keepdims:
            return tuple(1 if axis in axes else size for axis, size in enumerate(input_shape))
        return tuple(size for axis, size in enumerate(input_shape) if axis not in axes)


def as_scalar_or_vector(value: float | Sequence[float]) -> float | tuple[float, ...]:
    """A number as a float, a list as a tuple of floats."""
    if isinstance(value, Sequence):
        return tuple(float(item) for item in value)
    return float(value)


@attrs.frozen
class Rescale(Layer):
    """Keras's Rescaling: ``x * scale + offset``, the product rounded first. ``scale`` and
    ``offset`` are each a number, or a list of one per channel of the last axis (a per-channel
    normalisation: Keras's Normalization as ``scale = 1 / std``, ``offset = -mean / std``)."""

    type: ClassVar[str] = "rescale"
    scale: float | tuple[float, ...] = attrs.field(converter=as_scalar_or_vector)
    offset: float | tuple[float, ...] = attrs.field(default=0.0, converter=as_scalar_or_vector)

    def output_shape(self, input_shape: Shape) -> Shape:
        for name in ("scale", "offset"):
            value = getattr(self, name)
            if isinstance(value, tuple) and (not input_shape or len(value) != input_shape[-1]):
                raise ValueError(
                    f"{name} has {len(value)} values; the input's last axis has "
                    f"{input_shape[-1] if input_shape else 'none'}"
                )
        return input_shape

    @property
    def per_channel(self) -> bool:
        """Whether scale or offset is a vector over the last axis."""
        return isinstance(self.scale, tuple) or isinstance(self.offset, tuple)


# --------------------------------------------------------------------------- activations


@attrs.frozen
class ReLU(Layer):
    type: ClassVar[str] = "relu"


@attrs.frozen
class LeakyReLU(Layer):
    """``x`` where positive, ``negative_slope * x`` elsewhere; the default slope is Keras's
    (0.3), not torch's (0.01)."""

    type: ClassVar[str] = "leaky_relu"
    negative_slope: float = attrs.field(default=0.3, validator=attrs.validators.ge(0.0))


@attrs.frozen
class GELU(Layer):
    """Exact (erf) GELU, the default of both frameworks' functional forms."""

    type: ClassVar[str] = "gelu"


@attrs.frozen
class Tanh(Layer):
    type: ClassVar[str] = "tanh"


#: ``activation = NAME`` on a dense or conv2d layer, as Keras writes it: the layer that
#: :func:`split_activation` puts after it (so every backend builds it with the tables it
#: has). ``leaky_relu`` is Keras's activation function, whose slope is 0.2 (its LeakyReLU
#: *layer*'s, and crosstrain's ``leaky_relu`` layer's default, is 0.3); ``linear`` is none.
ACTIVATIONS: dict[str, Layer | None] = {
    "relu": ReLU(),
    "gelu": GELU(),
    "tanh": Tanh(),
    "leaky_relu": LeakyReLU(negative_slope=0.2),
    "sigmoid": Sigmoid(),
    "silu": SiLU(),
    "swish": SiLU(),  # Keras's other name for silu
    "relu6": ReLU6(),
    "hard_swish": HardSwish(),
    "hard_silu": HardSwish(),  # Keras's other name for hard_swish
    "linear": None,
}
#: activation names Keras knows that are refused with the reason, rather than as unknown
NOT_ACTIVATIONS = {
    "softmax": "loss cross_entropy reads logits (Keras's from_logits=True), so the last layer "
    "has no activation",
}


def split_activation(layer: Layer) -> tuple[Layer, Layer | None]:
    """A layer with ``activation`` as the layer without it and the activation layer after
    it; any other layer as itself and None."""
    if not isinstance(layer, Dense | Conv2D | Conv1D | Conv2DTranspose) or layer.activation is None:
        return layer, None
    return attrs.evolve(layer, activation=None), ACTIVATIONS[layer.activation]


@attrs.frozen
class Dropout(Layer):
    """Dropout whose masks come from crosstrain's counter-based hash
    (:mod:`crosstrain.core.dropout`), so every backend and world size drops the same units.

    ``per_row = true`` keeps or drops each row's whole input at once (stochastic depth, Keras's
    ``Dropout(noise_shape=(None, 1, ...))``): the row's one hash is its unit 0's."""

    type: ClassVar[str] = "dropout"
    later_fields: ClassVar[tuple[str, ...]] = ("per_row",)
    rate: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])
    per_row: bool = False

    def mask_units(self, input_shape: Shape) -> int:
        """How many units of a row the mask draws (one per row, or one per value)."""
        return 1 if self.per_row else math.prod(input_shape)


# --------------------------------------------------------------------------- normalisation


@attrs.frozen
class LayerNorm(Layer):
    """Normalises the last axis; scale [features] starts at 1, offset at 0."""

    type: ClassVar[str] = "layernorm"
    eps: float = attrs.field(default=1e-5, validator=attrs.validators.gt(0.0))

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        features = (input_shape[-1],)
        return {"scale": WeightSpec(features, "ones"), "offset": WeightSpec(features, "zeros")}


@attrs.frozen
class BatchNorm(Layer):
    """Normalises each feature of the last axis over every other axis and over the real rows
    of the whole (micro-)batch, across every replica and process, so world N equals world 1.

    Training uses the batch's mean and biased variance; the running statistics move as
    ``running = momentum * running + (1 - momentum) * batch`` (the unbiased variance, as
    torch), and evaluation uses them. ``momentum``/``epsilon`` are crosstrain's defaults.
    ``scale = false`` / ``center = false`` (Keras's options) leave out the ``scale`` /
    ``offset`` weight and its multiply / add."""

    type: ClassVar[str] = "batchnorm"
    later_fields: ClassVar[tuple[str, ...]] = ("scale", "center")
    momentum: float = attrs.field(default=0.9, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])
    epsilon: float = attrs.field(default=1e-5, validator=attrs.validators.gt(0.0))
    scale: bool = True
    center: bool = True

    def output_shape(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise ValueError("batchnorm needs at least one feature axis")
        return input_shape

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        features = (input_shape[-1],)
        affine = {"scale": WeightSpec(features, "ones"), "offset": WeightSpec(features, "zeros")}
        return {
            **{name: spec for name, spec in affine.items() if self.affine[name]},
            "moving_mean": WeightSpec(features, "zeros", trainable=False),
            "moving_variance": WeightSpec(features, "ones", trainable=False),
        }

    @property
    def affine(self) -> dict[str, bool]:
        """Which of the ``scale`` and ``offset`` weights this norm has."""
        return {"scale": self.scale, "offset": self.center}


# --------------------------------------------------------------------------- sequences


@attrs.frozen
class Embedding(Layer):
    """Token ids [length] -> vectors [length, units]; table [vocab_size, units], N(0, 0.02)."""

    type: ClassVar[str] = "embedding"
    accepts: ClassVar[tuple[DType, ...]] = ("int32",)
    vocab_size: int = attrs.field(validator=_positive)
    units: int = attrs.field(validator=_positive)

    def output_shape(self, input_shape: Shape) -> Shape:
        return (*input_shape, self.units)

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"table": WeightSpec((self.vocab_size, self.units), "normal")}


@attrs.frozen
class PositionEmbedding(Layer):
    """Learned positions added to [length, units]: table [length, units], N(0, 0.02)."""

    type: ClassVar[str] = "position_embedding"

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 2, "a sequence [length, units]")
        return input_shape

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"table": WeightSpec(input_shape, "normal")}


#: the projections of attention, in the order their weights are made
ATTENTION_PROJECTIONS = ("query", "key", "value", "output")


@attrs.frozen
class Attention(Layer):
    """Multi-head self-attention on [length, units]: query, key, value and output
    projections ([units, units] kernels, biases), scaled dot products, softmax in fp32,
    ``causal`` masking of later positions.

    ``kv_heads`` (grouped-query attention, Llama 2/3): keys and values have that many heads,
    each shared by ``heads / kv_heads`` consecutive query heads; their kernels are then
    [units, kv_heads x head units]. ``rotary``: rotary position embedding on queries and
    keys (the half-split convention of GPT-NeoX and Hugging Face's Llama, base
    ``rotary_base``). A second input, a [length] mask (1 a real token, 0 padding, as
    ``padding_mask`` makes), keeps every query from attending to padded keys."""

    type: ClassVar[str] = "attention"
    later_fields: ClassVar[tuple[str, ...]] = ("kv_heads", "rotary", "rotary_base", "use_bias")
    optional_inputs: ClassVar[tuple[str, ...]] = ("a padding mask [length]",)
    heads: int = attrs.field(validator=_positive)
    causal: bool = False
    kv_heads: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    rotary: bool = False
    rotary_base: float = attrs.field(default=10000.0, validator=attrs.validators.gt(0.0))
    use_bias: bool = True

    def __attrs_post_init__(self) -> None:
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"'kv_heads' ({self.kv_heads}) must divide 'heads' ({self.heads})")

    @property
    def key_heads(self) -> int:
        """The heads of keys and values: ``kv_heads``, else ``heads``."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 2, "a sequence [length, units]")
        if input_shape[-1] % self.heads:
            raise ValueError(f"{input_shape[-1]} units do not split into {self.heads} heads")
        if self.rotary and input_shape[-1] // self.heads % 2:
            raise ValueError(
                f"rotary needs an even number of units per head, got {input_shape[-1] // self.heads}"
            )
        return input_shape

    def merged_shape(self, input_shapes: Sequence[Shape]) -> Shape:
        output = self.output_shape(input_shapes[0])
        for mask in input_shapes[1:]:
            if mask != input_shapes[0][:1]:
                raise ValueError(
                    f"the padding mask must be [length] = {list(input_shapes[0][:1])}, got {list(mask)}"
                )
        return output

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        units = input_shape[-1]
        key_units = units // self.heads * self.key_heads
        specs: dict[str, WeightSpec] = {}
        for projection in ATTENTION_PROJECTIONS:
            width = key_units if projection in ("key", "value") else units
            specs[f"{projection}_kernel"] = _glorot((units, width), units, width)
            if self.use_bias:
                specs[f"{projection}_bias"] = WeightSpec((width,), "zeros")
        return specs

    def multiply_adds(self, input_shape: Shape) -> int:
        length, units = input_shape
        key_units = units // self.heads * self.key_heads
        return 2 * length * units * (units + key_units) + 2 * length * length * units


def rotary_tables(length: int, head_units: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Rotary position embedding's cos and sin, float32 [length, head_units], computed in
    float64 (every backend rotates by these same numbers): position p turns the pair
    (i, i + head_units/2) by p x base^(-2i/head_units), the half-split convention of
    GPT-NeoX and Hugging Face's Llama (``rotate_half``), not the interleaved pairs of
    Meta's original Llama code."""
    half = head_units // 2
    frequencies = base ** (-np.arange(half, dtype=np.float64) * 2.0 / head_units)
    angles = np.arange(length, dtype=np.float64)[:, None] * frequencies[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@attrs.frozen
class RMSNorm(Layer):
    """Root-mean-square norm of the last axis, Llama's: ``x / sqrt(mean(x^2) + epsilon) *
    scale``, computed in fp32 (as layer norm is); scale [features] starts at 1."""

    type: ClassVar[str] = "rmsnorm"
    epsilon: float = attrs.field(default=1e-6, validator=attrs.validators.gt(0.0))

    def output_shape(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise ValueError("rmsnorm needs at least one feature axis")
        return input_shape

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"scale": WeightSpec((input_shape[-1],), "ones")}


@attrs.frozen
class ClassToken(Layer):
    """A learned token [1, units] put before a sequence (ViT's class token): [length, units]
    -> [length + 1, units]; the token starts at 0, as torchvision's."""

    type: ClassVar[str] = "class_token"

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 2, "a sequence [length, units]")
        return (input_shape[0] + 1, input_shape[1])

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"token": WeightSpec((1, input_shape[-1]), "zeros")}


@attrs.frozen
class Take(Layer):
    """One position of a row's first axis: [length, ...] -> [...] at ``index`` (negative
    counts from the end). ViT's head reads the class token, ``x[:, 0]``."""

    type: ClassVar[str] = "take"
    index: int = 0

    def output_shape(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise ValueError("take needs an axis to take from, got a row of one value")
        if not -input_shape[0] <= self.index < input_shape[0]:
            raise ValueError(f"index {self.index} is outside the first axis of {list(input_shape)}")
        return input_shape[1:]


@attrs.frozen
class PaddingMask(Layer):
    """Token ids -> float 1 where the id is a real token, 0 where it is ``pad_id``: the
    padding mask attention takes as its second input (Keras's ``mask_zero``)."""

    type: ClassVar[str] = "padding_mask"
    accepts: ClassVar[tuple[DType, ...]] = ("int32",)
    pad_id: int = attrs.field(default=0, validator=attrs.validators.ge(0))


# --------------------------------------------------------------------------- merges


def _expect_inputs(layer: Layer, input_shapes: Sequence[Shape]) -> None:
    if len(input_shapes) < 2:
        raise ValueError(f"{layer.type} joins two or more inputs, got {len(input_shapes)}")


@attrs.frozen
class Add(Layer):
    """Sums two or more inputs of the same shape (a residual connection)."""

    type: ClassVar[str] = "add"
    arity: ClassVar[int | None] = None

    def merged_shape(self, input_shapes: Sequence[Shape]) -> Shape:
        _expect_inputs(self, input_shapes)
        if len(set(input_shapes)) != 1:
            raise ValueError(f"add needs inputs of one shape, got {[list(s) for s in input_shapes]}")
        return input_shapes[0]


@attrs.frozen
class Concat(Layer):
    """Joins two or more inputs on the last axis; the other axes must agree."""

    type: ClassVar[str] = "concat"
    arity: ClassVar[int | None] = None

    def merged_shape(self, input_shapes: Sequence[Shape]) -> Shape:
        _expect_inputs(self, input_shapes)
        leading = {shape[:-1] for shape in input_shapes}
        if any(not shape for shape in input_shapes) or len(leading) != 1:
            shapes = [list(shape) for shape in input_shapes]
            raise ValueError(f"concat needs inputs that differ only in the last axis, got {shapes}")
        return (*input_shapes[0][:-1], sum(shape[-1] for shape in input_shapes))


@attrs.frozen
class Block(Layer):
    """Runs ``model.blocks.NAME`` ``repeat`` times in sequence, each repeat with its own
    weights; ``repeat = 0`` leaves it out (its output is its input: a shallower model from
    ``--set``). A second input (a padding mask) is a side input: every repeat's layers read
    it by its name."""

    type: ClassVar[str] = "block"
    optional_inputs: ClassVar[tuple[str, ...]] = ("a side input its layers read by name",)
    block: str = attrs.field()
    repeat: int = attrs.field(default=1, validator=_not_negative)


#: every layer type by its plan tag: the vocabulary a plan's layers are checked against.
#: A new layer type is its class above, its class here and its name in ``__all__`` below;
#: each backend's ``LAYERS`` table then needs one row for it (a test fails until it has one).
LAYER_TYPES: dict[str, type[Layer]] = {
    cls.type: cls
    for cls in (
        Dense,
        Conv2D,
        MaxPool2D,
        AvgPool2D,
        GlobalAvgPool2D,
        Flatten,
        Conv1D,
        Conv2DTranspose,
        UpSample2D,
        ZeroPad2D,
        Sigmoid,
        SiLU,
        Softmax,
        ReLU6,
        HardSwish,
        Multiply,
        Reshape,
        Transpose,
        Mean,
        Rescale,
        ReLU,
        LeakyReLU,
        GELU,
        Tanh,
        Dropout,
        LayerNorm,
        BatchNorm,
        Embedding,
        PositionEmbedding,
        Attention,
        RMSNorm,
        ClassToken,
        Take,
        PaddingMask,
        Add,
        Concat,
        Block,
    )
}
#: what ``crosstrain`` re-exports from here (``from crosstrain import Dense``): the base and
#: every layer type, so ``crosstrain/__init__.py`` needs no line for a new one
__all__ = [
    "GELU",
    "Add",
    "Attention",
    "AvgPool2D",
    "BatchNorm",
    "Block",
    "ClassToken",
    "Concat",
    "Conv1D",
    "Conv2D",
    "Conv2DTranspose",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "GlobalAvgPool2D",
    "HardSwish",
    "Layer",
    "LayerNorm",
    "LeakyReLU",
    "MaxPool2D",
    "Mean",
    "Multiply",
    "PaddingMask",
    "PositionEmbedding",
    "RMSNorm",
    "ReLU",
    "ReLU6",
    "Rescale",
    "Reshape",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Take",
    "Tanh",
    "Transpose",
    "UpSample2D",
    "ZeroPad2D",
]


def layer_name(layer: Layer, index: int) -> str:
    """The neutral name of a layer in its list: its own ``name``, else ``{type}_{index}``."""
    return layer.name or f"{layer.type}_{index}"
