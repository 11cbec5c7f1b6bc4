"""Normalisation layers: batch norm (with its moving statistics), layer norm and RMS norm."""

from __future__ import annotations

from typing import ClassVar

import attrs

from crosstrain.core.model.layers.base import Layer, Shape, WeightSpec

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "BatchNorm",
    "LayerNorm",
    "RMSNorm",
]


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
