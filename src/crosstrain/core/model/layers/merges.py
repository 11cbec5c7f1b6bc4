"""Layers that join tensors (``add``, ``multiply``, ``concat``) and ``block``, which repeats a
named list of layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs

from crosstrain.core.model.layers.base import Layer, Shape, not_negative

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "Add",
    "Block",
    "Concat",
    "Multiply",
]


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
    repeat: int = attrs.field(default=1, validator=not_negative)
