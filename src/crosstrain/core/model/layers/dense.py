"""The dense layer, ``rescale`` (x * a + b) and ``dropout``; :func:`split_activation`, which
turns a layer's ``activation`` into the activation layer after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import attrs

from crosstrain.core.model.layers.activations import ACTIVATIONS, known_activation
from crosstrain.core.model.layers.base import Layer, Shape, WeightSpec, glorot, positive
from crosstrain.core.model.layers.convolutions import Conv1D, Conv2D, Conv2DTranspose

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "Dense",
    "Dropout",
    "LayerScale",
    "Rescale",
]


@attrs.frozen
class Dense(Layer):
    """Fully connected on the last axis, as in Keras: kernel [in, out], bias [out]."""

    type: ClassVar[str] = "dense"
    later_fields: ClassVar[tuple[str, ...]] = ("tie",)
    units: int = attrs.field(validator=positive)
    use_bias: bool = True
    #: Keras's ``activation="relu"``: the graph adds that activation layer after this one
    activation: str | None = attrs.field(default=None, kw_only=True, validator=known_activation)
    #: weight tying (GPT-2, Llama's output): the name of an earlier embedding layer of the same
    #: list, whose table [vocab_size, units] transposed is this layer's kernel; the layer then
    #: has no kernel of its own (the graph checks the shapes: crosstrain.core.model.graph)
    tie: str | None = attrs.field(default=None, kw_only=True)

    def output_shape(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise ValueError("dense needs at least one feature axis")
        return (*input_shape[:-1], self.units)

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        fan_in = input_shape[-1]
        specs: dict[str, WeightSpec] = {}
        if self.tie is None:
            specs["kernel"] = glorot((fan_in, self.units), fan_in, self.units)
        if self.use_bias:
            specs["bias"] = WeightSpec((self.units,), "zeros")
        return specs

    def multiply_adds(self, input_shape: Shape) -> int:
        return math.prod(input_shape) * self.units


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


@attrs.frozen
class LayerScale(Layer):
    """A learned multiplier per feature of the last axis, ``x * scale`` (ConvNeXt's and
    CaiT's layer scale, Keras's ``LayerScale``): scale [features] starts at ``initial``."""

    type: ClassVar[str] = "layer_scale"
    initial: float = 1.0

    def output_shape(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise ValueError("scale needs at least one feature axis")
        return input_shape

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"scale": WeightSpec((input_shape[-1],), "constant", value=self.initial)}


def split_activation(layer: Layer) -> tuple[Layer, Layer | None]:
    """A layer with ``activation`` as the layer without it and the activation layer after
    it; any other layer as itself and None."""
    if not isinstance(layer, Dense | Conv2D | Conv1D | Conv2DTranspose) or layer.activation is None:
        return layer, None
    return attrs.evolve(layer, activation=None), ACTIVATIONS[layer.activation]


@attrs.frozen
class Dropout(Layer):
    """Dropout whose masks come from crosstrain's counter-based hash
    (:mod:`crosstrain.core.model.dropout`), so every backend and world size drops the same units.

    ``per_row = true`` keeps or drops each row's whole input at once (stochastic depth, Keras's
    ``Dropout(noise_shape=(None, 1, ...))``): the row's one hash is its unit 0's."""

    type: ClassVar[str] = "dropout"
    later_fields: ClassVar[tuple[str, ...]] = ("per_row",)
    rate: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])
    per_row: bool = False

    def mask_units(self, input_shape: Shape) -> int:
        """How many units of a row the mask draws (one per row, or one per value)."""
        return 1 if self.per_row else math.prod(input_shape)
