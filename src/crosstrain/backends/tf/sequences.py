"""The sequence layers written here: token and position embeddings, attention, the class
token and the padding mask. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from crosstrain.core.model.layers import (
    Attention,
)
from crosstrain.core.model.layers.sequences import ATTENTION_PROJECTIONS, rotary_tables


class TokenEmbedding(keras.layers.Layer):  # type: ignore[misc]
    """``table[ids]``; the table's gradient comes back as IndexedSlices."""

    def __init__(self, vocab_size: int, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.units = vocab_size, units

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.table = self.add_weight(shape=(self.vocab_size, self.units), initializer="zeros", name="table")

    def call(self, inputs: Any) -> Any:
        return tf.cast(tf.gather(self.table, tf.cast(inputs, tf.int32)), self.compute_dtype)


class PositionTable(keras.layers.Layer):  # type: ignore[misc]
    """``x + table``, the table [length, units] broadcast over the batch."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="zeros", name="table")

    def call(self, inputs: Any) -> Any:
        return inputs + tf.cast(self.table, inputs.dtype)


class SelfAttention(keras.layers.Layer):  # type: ignore[misc]
    """Multi-head self-attention as docs/layers.md writes it: projections in the compute
    dtype, scores scaled by 1/sqrt(head units) and softmaxed in fp32 (the variables' dtype:
    float64 under fp64), later positions masked when causal. Grouped keys and values
    (``kv_heads``) serve ``heads / kv_heads`` consecutive query heads each; ``rotary`` turns
    queries and keys by core's tables; a second input, the padding mask [batch, length],
    adds -1e9 to padded keys' scores."""

    def __init__(self, layer: Attention, length: int, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads, self.causal, self.use_bias = layer.heads, layer.causal, layer.use_bias
        self.depth = units // layer.heads
        self.groups = layer.heads // layer.key_heads
        self.rotary = (
            tuple(tf.constant(table) for table in rotary_tables(length, self.depth, layer.rotary_base))
            if layer.rotary
            else None
        )

    def build(self, input_shape: Any) -> None:
        shape = input_shape[0] if isinstance(input_shape, list) else input_shape
        units = int(shape[-1])
        key_units = self.depth * (self.heads // self.groups)
        for projection in ATTENTION_PROJECTIONS:
            width = key_units if projection in ("key", "value") else units
            kernel = self.add_weight(shape=(units, width), initializer="zeros", name=f"{projection}_kernel")
            setattr(self, f"{projection}_kernel", kernel)
            if self.use_bias:
                bias = self.add_weight(shape=(width,), initializer="zeros", name=f"{projection}_bias")
                setattr(self, f"{projection}_bias", bias)

    def _project(self, x: Any, projection: str) -> Any:
        kernel = tf.cast(getattr(self, f"{projection}_kernel"), self.compute_dtype)
        projected = tf.matmul(x, kernel)
        if not self.use_bias:
            return projected
        return projected + tf.cast(getattr(self, f"{projection}_bias"), self.compute_dtype)

    def _rotate(self, x: Any) -> Any:
        """x [batch, heads, length, depth] turned by the rotary tables (half-split)."""
        assert self.rotary is not None
        cos, sin = (tf.cast(table, x.dtype) for table in self.rotary)
        half = self.depth // 2
        turned = tf.concat([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + turned * sin

    def call(self, inputs: Any) -> Any:
        x, padding = (inputs[0], inputs[1]) if isinstance(inputs, list | tuple) else (inputs, None)
        length, units = int(x.shape[1]), int(x.shape[2])

        def split(projection: str) -> Any:  # [batch, length, units] -> [batch, heads, length, depth]
            projected = self._project(x, projection)
            heads = int(projected.shape[-1]) // self.depth
            return tf.transpose(tf.reshape(projected, [-1, length, heads, self.depth]), [0, 2, 1, 3])

        query, key, value = split("query"), split("key"), split("value")
        if self.rotary is not None:
            query, key = self._rotate(query), self._rotate(key)
        if self.groups > 1:
            key, value = tf.repeat(key, self.groups, axis=1), tf.repeat(value, self.groups, axis=1)
        full = self.variable_dtype
        scores = tf.cast(tf.matmul(query, key, transpose_b=True), full) / math.sqrt(self.depth)
        if padding is not None:
            scores = scores + ((tf.cast(padding, full) - 1.0) * 1e9)[:, None, None, :]
        if self.causal:
            allowed = tf.linalg.band_part(tf.ones((length, length), tf.bool), -1, 0)
            scores = tf.where(allowed, scores, tf.constant(-math.inf, full))
        weights = tf.cast(tf.nn.softmax(scores, axis=-1), self.compute_dtype)
        attended = tf.transpose(tf.matmul(weights, value), [0, 2, 1, 3])
        return self._project(tf.reshape(attended, [-1, length, units]), "output")


class ClassTokenLayer(keras.layers.Layer):  # type: ignore[misc]
    """The learned token [1, units] before each row's sequence."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.token = self.add_weight(shape=(1, int(input_shape[-1])), initializer="zeros", name="token")  # type: ignore[arg-type]

    def call(self, inputs: Any) -> Any:
        token = tf.cast(self.token, inputs.dtype)[None]  # [1, 1, units]
        return tf.concat([tf.tile(token, [tf.shape(inputs)[0], 1, 1]), inputs], axis=1)


class PaddingMaskLayer(keras.layers.Layer):  # type: ignore[misc]
    """Token ids -> 1 (a real token) or 0 (``pad_id``), in the compute dtype."""

    def __init__(self, pad_id: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pad_id = pad_id

    def call(self, inputs: Any) -> Any:
        return tf.cast(tf.not_equal(inputs, self.pad_id), self.compute_dtype)
