"""What every neutral layer shares: the shape and dtype types, :class:`WeightSpec` (a weight's
shape and how it starts) and the :class:`Layer` base, with the checks the layer families
use.

Shapes here are one row's: the batch axis is never part of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

Shape = tuple[int, ...]


Weights = dict[str, np.ndarray]


Pair = tuple[int, int]


DType = Literal["float32", "int32"]


def positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    values = value if isinstance(value, tuple) else (value,)
    if any(item <= 0 for item in values):
        raise ValueError(f"'{attribute.name}' must be > 0, got {list(values) if len(values) > 1 else value}")


def not_negative(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise ValueError(f"'{attribute.name}' must be >= 0, got {value}")


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
    init: Literal["glorot", "zeros", "ones", "normal", "constant"]
    fan_in: int = 0
    fan_out: int = 0
    stddev: float = 0.02
    #: every entry's start under ``init = "constant"`` (a learned scale's start, ConvNeXt's 1e-6)
    value: float = 0.0
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
        if self.init == "constant":
            return np.full(self.shape, self.value, np.float32)
        return np.zeros(self.shape, np.float32)


def glorot(shape: Shape, fan_in: int, fan_out: int) -> WeightSpec:
    return WeightSpec(shape, "glorot", fan_in=fan_in, fan_out=fan_out, kernel=True)


#: every layer type by its plan tag: the vocabulary a plan's layers are checked against. Each
#: class with a ``type`` of its own enters it where it is defined (:meth:`Layer.__init_subclass__`),
#: in the order the family modules define them; a base without one (``_Pool2D``) stays out.
LAYER_TYPES: dict[str, type[Layer]] = {}


@attrs.frozen
class Layer:
    """Base of every neutral layer. ``type`` is the plan's tag; ``name`` (unique within its
    list) and ``inputs`` (names of earlier layers of the same list, or ``"input"``) are
    optional: without ``inputs`` a layer takes the previous layer's output.

    A subclass that sets ``type`` registers itself in :data:`LAYER_TYPES`; a tag another
    class already holds is refused when the second class is defined."""

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

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


def _register(cls: type[Layer]) -> None:
    tag = cls.__dict__.get("type")
    if not tag:  # Layer's own "" inherited, or no tag: a base, not a plan's layer type
        return
    holder = LAYER_TYPES.get(tag)
    if holder is not None and not _rebuilt_by_attrs(holder, cls):
        raise TypeError(
            f"layer type {tag!r} of {cls.__module__}.{cls.__qualname__} is already taken by "
            f"{holder.__module__}.{holder.__qualname__}: a plan's tag names one class"
        )
    LAYER_TYPES[tag] = cls


def _rebuilt_by_attrs(holder: type[Layer], cls: type[Layer]) -> bool:
    """attrs makes a slotted class anew from the class statement's own: the statement's class
    holds the tag (it has no attrs fields yet) until its rebuilt self takes it over."""
    return "__attrs_attrs__" not in holder.__dict__ and (holder.__module__, holder.__qualname__) == (
        cls.__module__,
        cls.__qualname__,
    )


def expect_rank(layer: Layer, input_shape: Shape, rank: int, what: str) -> None:
    if len(input_shape) != rank:
        raise ValueError(f"{layer.type} expects {what}, got input shape {list(input_shape)}")


def expect_image(layer: Layer, input_shape: Shape) -> None:
    expect_rank(layer, input_shape, 3, "an image input [height, width, channels]")
