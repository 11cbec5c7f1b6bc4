"""Sequence layers: token and position embeddings, attention (grouped-query, rotary, causal,
with a padding mask), the class token and the padding mask itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import numpy as np

from crosstrain.core.model.layers.base import DType, Layer, Shape, WeightSpec, expect_rank, glorot, positive

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "Attention",
    "ClassToken",
    "Embedding",
    "PaddingMask",
    "PositionEmbedding",
]


@attrs.frozen
class Embedding(Layer):
    """Token ids [length] -> vectors [length, units]; table [vocab_size, units], N(0, 0.02)."""

    type: ClassVar[str] = "embedding"
    accepts: ClassVar[tuple[DType, ...]] = ("int32",)
    vocab_size: int = attrs.field(validator=positive)
    units: int = attrs.field(validator=positive)

    def output_shape(self, input_shape: Shape) -> Shape:
        return (*input_shape, self.units)

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"table": WeightSpec((self.vocab_size, self.units), "normal")}


@attrs.frozen
class PositionEmbedding(Layer):
    """Learned positions added to [length, units]: table [length, units], N(0, 0.02)."""

    type: ClassVar[str] = "position_embedding"

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_rank(self, input_shape, 2, "a sequence [length, units]")
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
    heads: int = attrs.field(validator=positive)
    causal: bool = False
    kv_heads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
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
        expect_rank(self, input_shape, 2, "a sequence [length, units]")
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
            specs[f"{projection}_kernel"] = glorot((units, width), units, width)
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
class ClassToken(Layer):
    """A learned token [1, units] put before a sequence (ViT's class token): [length, units]
    -> [length + 1, units]; the token starts at 0, as torchvision's."""

    type: ClassVar[str] = "class_token"

    def output_shape(self, input_shape: Shape) -> Shape:
        expect_rank(self, input_shape, 2, "a sequence [length, units]")
        return (input_shape[0] + 1, input_shape[1])

    def weight_specs(self, input_shape: Shape) -> dict[str, WeightSpec]:
        return {"token": WeightSpec((1, input_shape[-1]), "zeros")}


@attrs.frozen
class PaddingMask(Layer):
    """Token ids -> float 1 where the id is a real token, 0 where it is ``pad_id``: the
    padding mask attention takes as its second input (Keras's ``mask_zero``)."""

    type: ClassVar[str] = "padding_mask"
    accepts: ClassVar[tuple[DType, ...]] = ("int32",)
    pad_id: int = attrs.field(default=0, validator=attrs.validators.ge(0))
