"""The neutral layer vocabulary: shapes are channels-last, weights are numpy.

Each layer knows its output shape (so a plan is checked end to end before any
process starts) and how to make its initial weights from the plan's seed, with
the usual default of its kind: Glorot-uniform kernels, zero biases, unit scales.
Both backends receive exactly these arrays (DESIGN rules 1 and 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import attrs
import numpy as np

from crosstrain.core.errors import PlanError

Shape = tuple[int, ...]
Weights = dict[str, np.ndarray]


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"'{attribute.name}' must be > 0, got {value}")


@attrs.frozen
class Layer:
    """Base of every neutral layer. ``type`` is the plan's tag; ``name`` is optional."""

    type: ClassVar[str] = ""
    name: str | None = attrs.field(default=None, kw_only=True)

    def output_shape(self, input_shape: Shape) -> Shape:
        return input_shape

    def init_weights(self, input_shape: Shape, rng: np.random.Generator) -> Weights:
        return {}


def _glorot_uniform(shape: Shape, fan_in: int, fan_out: int, rng: np.random.Generator) -> np.ndarray:
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def _expect_rank(layer: Layer, input_shape: Shape, rank: int, what: str) -> None:
    if len(input_shape) != rank:
        raise ValueError(f"{layer.type} expects {what}, got input shape {list(input_shape)}")


@attrs.frozen
class Dense(Layer):
    """Fully connected: kernel [in, out], bias [out]; acts on the last axis."""

    type: ClassVar[str] = "dense"
    units: int = attrs.field(validator=_positive)
    use_bias: bool = True

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 1, "a flat [features] input (add a flatten layer)")
        return (self.units,)

    def init_weights(self, input_shape: Shape, rng: np.random.Generator) -> Weights:
        fan_in = input_shape[-1]
        weights = {"kernel": _glorot_uniform((fan_in, self.units), fan_in, self.units, rng)}
        if self.use_bias:
            weights["bias"] = np.zeros(self.units, np.float32)
        return weights


def _window_output(size: int, window: int, stride: int, padding: str) -> int:
    if padding == "same":
        return math.ceil(size / stride)
    return (size - window) // stride + 1


@attrs.frozen
class Conv2D(Layer):
    """2-D convolution on NHWC input: kernel [kh, kw, in, out], bias [out]."""

    type: ClassVar[str] = "conv2d"
    filters: int = attrs.field(validator=_positive)
    kernel_size: int = attrs.field(validator=_positive)
    strides: int = attrs.field(default=1, validator=_positive)
    padding: Literal["valid", "same"] = attrs.field(
        default="valid", validator=attrs.validators.in_(("valid", "same"))
    )
    use_bias: bool = True

    def __attrs_post_init__(self) -> None:
        # torch has no asymmetric 'same' padding for strides > 1; refusing it keeps parity honest.
        if self.padding == "same" and self.strides != 1:
            raise ValueError("padding 'same' needs strides = 1")

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 3, "an image input [height, width, channels]")
        height, width, _ = input_shape
        out_h = _window_output(height, self.kernel_size, self.strides, self.padding)
        out_w = _window_output(width, self.kernel_size, self.strides, self.padding)
        if out_h <= 0 or out_w <= 0:
            raise ValueError(f"kernel {self.kernel_size} does not fit input shape {list(input_shape)}")
        return (out_h, out_w, self.filters)

    def init_weights(self, input_shape: Shape, rng: np.random.Generator) -> Weights:
        channels = input_shape[-1]
        receptive = self.kernel_size * self.kernel_size
        shape = (self.kernel_size, self.kernel_size, channels, self.filters)
        weights = {"kernel": _glorot_uniform(shape, receptive * channels, receptive * self.filters, rng)}
        if self.use_bias:
            weights["bias"] = np.zeros(self.filters, np.float32)
        return weights


@attrs.frozen
class MaxPool2D(Layer):
    """Max pooling on NHWC input, 'valid' padding; strides default to the pool size."""

    type: ClassVar[str] = "maxpool2d"
    pool_size: int = attrs.field(default=2, validator=_positive)
    strides: int | None = None

    @property
    def effective_strides(self) -> int:
        return self.strides if self.strides is not None else self.pool_size

    def output_shape(self, input_shape: Shape) -> Shape:
        _expect_rank(self, input_shape, 3, "an image input [height, width, channels]")
        height, width, channels = input_shape
        out_h = _window_output(height, self.pool_size, self.effective_strides, "valid")
        out_w = _window_output(width, self.pool_size, self.effective_strides, "valid")
        if out_h <= 0 or out_w <= 0:
            raise ValueError(f"pool {self.pool_size} does not fit input shape {list(input_shape)}")
        return (out_h, out_w, channels)


@attrs.frozen
class Flatten(Layer):
    """Flattens in channels-last (NHWC) order; torch must permute before flattening."""

    type: ClassVar[str] = "flatten"

    def output_shape(self, input_shape: Shape) -> Shape:
        return (math.prod(input_shape),)


@attrs.frozen
class ReLU(Layer):
    type: ClassVar[str] = "relu"


@attrs.frozen
class GELU(Layer):
    """Exact (erf) GELU, the default of both frameworks' functional forms."""

    type: ClassVar[str] = "gelu"


@attrs.frozen
class Tanh(Layer):
    type: ClassVar[str] = "tanh"


@attrs.frozen
class Dropout(Layer):
    """Dropout; each framework draws its own masks, so plans with dropout lose exact parity."""

    type: ClassVar[str] = "dropout"
    rate: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])


@attrs.frozen
class LayerNorm(Layer):
    """Normalises the last axis; scale [features] starts at 1, offset at 0."""

    type: ClassVar[str] = "layernorm"
    eps: float = attrs.field(default=1e-5, validator=attrs.validators.gt(0.0))

    def init_weights(self, input_shape: Shape, rng: np.random.Generator) -> Weights:
        features = input_shape[-1]
        return {"scale": np.ones(features, np.float32), "offset": np.zeros(features, np.float32)}


LAYER_TYPES: dict[str, type[Layer]] = {
    cls.type: cls for cls in (Dense, Conv2D, MaxPool2D, Flatten, ReLU, GELU, Tanh, Dropout, LayerNorm)
}


def layer_name(layer: Layer, index: int) -> str:
    """The neutral name of a layer: its own ``name``, else ``{type}_{index}``."""
    return layer.name or f"{layer.type}_{index}"


def infer_shapes(input_shape: Shape, layers: Sequence[Layer], source: str | None = None) -> list[Shape]:
    """Return the shape after each layer; a misfit names the layer and both shapes."""
    shapes: list[Shape] = []
    current = tuple(input_shape)
    for index, layer in enumerate(layers):
        try:
            current = layer.output_shape(current)
        except ValueError as error:
            raise PlanError(
                f"layer {layer_name(layer, index)!r}: {error}",
                field=f"model.layers[{index}]",
                source=source,
            ) from None
        shapes.append(current)
    return shapes


def init_weights(input_shape: Shape, layers: Sequence[Layer], seed: int) -> Weights:
    """Seeded initial weights keyed ``{layer_name}.{param}``, identical for every backend.

    Each layer draws from its own stream (seed, index), so adding a layer later in
    the model does not change the weights of the layers before it.
    """
    weights: Weights = {}
    current = tuple(input_shape)
    for index, layer in enumerate(layers):
        rng = np.random.default_rng([seed, index])
        for param, value in layer.init_weights(current, rng).items():
            weights[f"{layer_name(layer, index)}.{param}"] = value
        current = layer.output_shape(current)
    return weights
