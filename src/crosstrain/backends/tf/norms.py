"""The normalisation layers written here: batch norm over the real rows of every replica,
RMS norm. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from crosstrain.backends.tf.nodes import ContextLayer, sum_across_replicas


class NeutralBatchNorm(ContextLayer):
    """docs/layers.md's batch norm, in fp32 (built with the float32 policy; float64 under fp64).

    The moving statistics are non-trainable variables updated in the forward pass. Every
    replica computes the same global statistics; ``ONLY_FIRST_REPLICA`` makes each update
    write replica 0's value to every copy, so the copies stay identical bit for bit."""

    def __init__(
        self, momentum: float, epsilon: float, scale: bool = True, center: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.momentum, self.epsilon = momentum, epsilon
        self.has_scale, self.has_offset = scale, center

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        features = (int(input_shape[-1]),)  # type: ignore[arg-type]
        # absent under Keras's scale=False / center=False
        self.scale = (
            self.add_weight(shape=features, initializer="ones", name="scale") if self.has_scale else None
        )
        self.offset = (
            self.add_weight(shape=features, initializer="zeros", name="offset") if self.has_offset else None
        )
        self.moving_mean = self._statistic(features, "zeros", "moving_mean")
        self.moving_variance = self._statistic(features, "ones", "moving_variance")

    def _statistic(self, shape: tuple[int], initializer: str, name: str) -> Any:
        return self.add_weight(
            shape=shape,
            initializer=initializer,
            trainable=False,
            autocast=False,
            aggregation="only_first_replica",
            name=name,
        )

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        x = tf.cast(inputs, self.variable_dtype)
        if training:
            mean, variance = self._batch_statistics(x, weight)
        else:
            mean, variance = self.moving_mean, self.moving_variance
        y = (x - mean) / tf.sqrt(variance + self.epsilon)
        if self.scale is not None:
            y = y * self.scale
        if self.offset is not None:
            y = y + self.offset
        return y

    def _batch_statistics(self, x: Any, weight: Any) -> tuple[Any, Any]:
        """Two all-reduced passes over the real rows: the mean, then the biased variance."""
        rank = len(x.shape)
        axes = list(range(rank - 1))
        row_weight = tf.ones(tf.shape(x)[:1], x.dtype) if weight is None else tf.cast(weight, x.dtype)
        broadcast = tf.reshape(row_weight, [-1] + [1] * (rank - 1))
        positions = math.prod(x.shape[1:-1])
        count = tf.reduce_sum(row_weight) * positions
        first = sum_across_replicas(tf.concat([tf.reduce_sum(x * broadcast, axes), count[None]], 0))
        count = tf.stop_gradient(first[-1])
        # a micro-batch of padding alone (the end of an epoch) has no statistics: divide by
        # 1 instead of 0 so nothing turns NaN, and leave the moving statistics alone
        divisor = tf.maximum(count, 1.0)
        mean = first[:-1] / divisor
        variance = sum_across_replicas(tf.reduce_sum(tf.square(x - mean) * broadcast, axes)) / divisor
        self._update_moving(tf.stop_gradient(mean), tf.stop_gradient(variance), count)
        return mean, variance

    def _update_moving(self, mean: Any, variance: Any, count: Any) -> None:
        unbiased = variance * (count / tf.maximum(count - 1.0, 1.0))
        real = count > 0.0
        for variable, batch in ((self.moving_mean, mean), (self.moving_variance, unbiased)):
            moved = self.momentum * variable + (1.0 - self.momentum) * batch
            variable.assign(tf.where(real, moved, variable))


# --------------------------------------------------------------------------- dropout


class RootMeanSquareNorm(keras.layers.Layer):  # type: ignore[misc]
    """docs/layers.md's RMS norm of the last axis, in the variables' dtype (fp32 under bf16 and
    fp16, float64 under fp64) whatever the compute dtype."""

    def __init__(self, epsilon: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.scale = self.add_weight(shape=(int(input_shape[-1]),), initializer="ones", name="scale")  # type: ignore[arg-type]

    def call(self, inputs: Any) -> Any:
        x = tf.cast(inputs, self.variable_dtype)
        normed = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + self.epsilon)
        return tf.cast(normed * self.scale, self.compute_dtype)
