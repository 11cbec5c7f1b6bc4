"""The dense family's layers written here: hashed dropout, the learned per-channel scale,
the dense tied to an embedding. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from crosstrain.backends.tf.nodes import ContextLayer
from crosstrain.core.model import dropout as neutral_dropout


def _mix(value: Any) -> Any:
    """crosstrain.core.model.dropout.mix in TensorFlow's int64 ops (products stay below 2**63)."""
    first, second = neutral_dropout.MULTIPLIERS
    mask = tf.constant(neutral_dropout.MASK32, tf.int64)
    value = tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(16, tf.int64)))
    value = tf.bitwise.bitwise_and(value * first, mask)
    value = tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(15, tf.int64)))
    value = tf.bitwise.bitwise_and(value * second, mask)
    return tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(16, tf.int64)))


def keep_mask(seed: int, step: Any, layer: int, rows: Any, features: int, rate: float) -> Any:
    """bool [rows, features], bit for bit :func:`crosstrain.core.model.dropout.keep_mask`."""
    mask = tf.constant(neutral_dropout.MASK32, tf.int64)
    step = tf.bitwise.bitwise_and(tf.cast(step, tf.int64), mask)
    state = _mix(tf.constant(seed & neutral_dropout.MASK32, tf.int64))
    state = _mix(tf.bitwise.bitwise_xor(state, step))
    state = _mix(tf.bitwise.bitwise_xor(state, tf.constant(layer & neutral_dropout.MASK32, tf.int64)))
    per_row = _mix(
        tf.bitwise.bitwise_xor(state, tf.bitwise.bitwise_and(tf.cast(rows, tf.int64), mask)[:, None])
    )
    hashed = _mix(tf.bitwise.bitwise_xor(per_row, tf.range(features, dtype=tf.int64)[None, :]))
    top = tf.bitwise.right_shift(hashed, tf.constant(32 - neutral_dropout.KEEP_BITS, tf.int64))
    return top >= neutral_dropout.threshold(rate)


class HashDropout(ContextLayer):
    """Dropout whose mask hashes (seed, step, node index, global row, feature): the same
    units drop in every framework and at every world size, with no generator state."""

    def __init__(
        self, rate: float, seed: int, layer_index: int, per_row: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.rate, self.seed, self.layer_index, self.per_row = rate, seed, layer_index, per_row

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        if not training or self.rate == 0.0:
            return inputs
        rows = tf.range(tf.shape(inputs)[0], dtype=tf.int64) if rows is None else rows
        step = tf.zeros((), tf.int64) if step is None else step
        # per row: one unit a row, broadcast over the row's values
        features = 1 if self.per_row else math.prod(inputs.shape[1:])
        keep = keep_mask(self.seed, step, self.layer_index, rows, features, self.rate)
        shape = [-1] + [1] * (len(inputs.shape) - 1) if self.per_row else tf.shape(inputs)
        keep = tf.cast(tf.reshape(keep, shape), inputs.dtype)
        return (inputs * keep) * (1.0 / (1.0 - self.rate))


# --------------------------------------------------------------------------- sequences


class FeatureScale(keras.layers.Layer):  # type: ignore[misc]
    """``x * scale`` over the last axis, as Keras's LayerScale computes it (the scale in the
    compute dtype)."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.scale = self.add_weight(shape=(int(input_shape[-1]),), initializer="ones", name="scale")  # type: ignore[arg-type]

    def call(self, inputs: Any) -> Any:
        return inputs * tf.cast(self.scale, inputs.dtype)


def _untied() -> Any:
    raise RuntimeError("a tied dense runs after GraphModel.tie hands it its embedding")


class TiedDense(keras.layers.Layer):  # type: ignore[misc]
    """A dense whose kernel is an embedding's table transposed (``tie``): the graph model
    hands it that embedding (:meth:`tie`); its own variable is the bias alone."""

    def __init__(self, units: int, use_bias: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units, self.use_bias = units, use_bias
        self.table: Callable[[], Any] = _untied

    def tie(self, embedding: keras.layers.Layer) -> None:
        # read through a function: an attribute holding the layer would make Keras track the
        # embedding, and its table, a second time
        self.table = lambda: embedding.table

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if self.use_bias:
            self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, inputs: Any) -> Any:
        outputs = tf.matmul(inputs, tf.cast(self.table(), self.compute_dtype), transpose_b=True)
        return outputs + tf.cast(self.bias, self.compute_dtype) if self.use_bias else outputs
