"""The normalisation nodes: layer norm, batch norm (its statistics over the real rows of the
global batch), RMS norm. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from crosstrain import (
    BatchNorm,
    LayerNorm,
    Node,
    RMSNorm,
)
from jax import lax

from crosstrain_jax.nodes import Apply, Env, layer_of, single


def build_layernorm(node: Node) -> Apply:
    eps = layer_of(node, LayerNorm).eps

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        """Over the last axis, in float32 even in bf16 runs (as torch's autocast does)."""
        x = single(inputs)
        x32 = x.astype(env.compute.full)
        mean = x32.mean(axis=-1, keepdims=True)
        variance = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
        normed = (x32 - mean) * lax.rsqrt(variance + eps)
        scale, offset = env.weights[f"{node.path}.scale"], env.weights[f"{node.path}.offset"]
        return (normed * scale + offset).astype(x.dtype)

    return apply


def batch_moments(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per feature of the last axis, over the real rows (weight 1) and every other axis:
    (n, mean, biased variance), two passes. ``x`` holds the global batch (sharded), so these
    sums are already across every replica."""
    row_weight = weight.reshape(-1, *([1] * (x.ndim - 1)))
    axes = tuple(range(x.ndim - 1))
    n = weight.sum() * math.prod(x.shape[1:-1])
    # An all-padding micro-batch (n = 0) would divide 0 by 0 and poison the gradient with
    # NaN even at weight 0; dividing by 1 instead leaves its zero sums zero.
    divisor = jnp.maximum(n, 1.0)
    mean = (row_weight * x).sum(axis=axes) / divisor
    variance = (row_weight * jnp.square(x - mean)).sum(axis=axes) / divisor
    return n, mean, variance


def build_batchnorm(node: Node) -> Apply:
    layer = layer_of(node, BatchNorm)
    names = {
        param: f"{node.path}.{param}"
        for param in ("scale", "offset", "moving_mean", "moving_variance")
    }

    def moved(old: jax.Array, batch: jax.Array, n: jax.Array) -> jax.Array:
        # A micro-batch of padding only (the tail of an epoch's last step) has no statistics
        # to contribute: it leaves the moving ones as they were.
        new = layer.momentum * old + (1 - layer.momentum) * lax.stop_gradient(batch)
        return jnp.where(n > 0, new, old)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = single(inputs)
        x32 = x.astype(env.compute.full)  # computed in fp32 whatever the precision (fp64: float64)
        if env.train is None:
            mean = env.weights[names["moving_mean"]]
            variance = env.weights[names["moving_variance"]]
        else:
            n, mean, variance = batch_moments(x32, env.train.weight)
            # n / (n - 1), with n - 1 clamped at 1 as torch does (one value: variance 0)
            unbiased = variance * n / jnp.maximum(n - 1, 1.0)
            env.updates[names["moving_mean"]] = moved(env.weights[names["moving_mean"]], mean, n)
            env.updates[names["moving_variance"]] = moved(
                env.weights[names["moving_variance"]], unbiased, n
            )
        normed = (x32 - mean) / jnp.sqrt(variance + layer.epsilon)
        # scale and offset absent under Keras's scale=False / center=False
        y = normed * env.weights[names["scale"]] if layer.scale else normed
        y = y + env.weights[names["offset"]] if layer.center else y
        return y.astype(x.dtype)

    return apply


def build_rmsnorm(node: Node) -> Apply:
    epsilon = layer_of(node, RMSNorm).epsilon

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        """Over the last axis, in float32 even in bf16 runs (as layer norm)."""
        x = single(inputs)
        x32 = x.astype(env.compute.full)
        normed = x32 * lax.rsqrt(jnp.square(x32).mean(axis=-1, keepdims=True) + epsilon)
        return (normed * env.weights[f"{node.path}.scale"]).astype(x.dtype)

    return apply
