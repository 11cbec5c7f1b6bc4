"""Layers that only rearrange or reduce a row: flatten, reshape, transpose, mean over axes,
take one position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from crosstrain.core.model.layers.base import Layer, Shape

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "Flatten",
    "Mean",
    "Reshape",
    "Take",
    "Transpose",
]


@attrs.frozen
class Flatten(Layer):
    """Flattens in channels-last (NHWC) order; torch must permute before flattening."""

    type: ClassVar[str] = "flatten"

    def output_shape(self, input_shape: Shape) -> Shape:
        return (math.prod(input_shape),)


def as_sizes(value: Sequence[int]) -> tuple[int, ...]:
    """A list of ints (axes, sizes) as a tuple."""
    return tuple(value)


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
