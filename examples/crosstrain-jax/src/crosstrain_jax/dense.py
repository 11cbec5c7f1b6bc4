"""The dense family's nodes: dense (tied to an embedding or not), dropout (crosstrain's
hashed masks, bit for bit), layer scale and rescale. What each computes is specified in
docs/layers.md."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import (
    Dense,
    Dropout,
    Node,
    Rescale,
    dropout,
)

from crosstrain_jax.nodes import Apply, Env, elementwise, layer_of, single


def build_dense(node: Node) -> Apply:
    layer = layer_of(node, Dense)

    def kernel(env: Env) -> jax.Array:
        if node.tied_to is None:
            return env.param(f"{node.path}.kernel")
        # tied: the embedding's table [vocab, units], transposed; its gradient sums both uses
        return env.param(env.tied_tables[node.index]).T

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # matmul contracts the last axis of any rank: [batch, ..., in] @ [in, out]
        y = jnp.matmul(single(inputs), kernel(env), precision=env.compute.matmul)
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


def build_rescale(node: Node) -> Apply:
    layer = layer_of(node, Rescale)
    # a vector (per channel of the last axis) in the input's dtype, as Keras casts it
    scale, offset = np.asarray(layer.scale, np.float32), np.asarray(layer.offset, np.float32)
    if not layer.per_channel:
        return elementwise(lambda x: x * layer.scale + layer.offset)(node)
    return elementwise(lambda x: x * scale.astype(x.dtype) + offset.astype(x.dtype))(node)


def _mix(value: jax.Array) -> jax.Array:
    """crosstrain.dropout.mix in uint32: a uint32 multiply wraps around, which is the
    reference's ``(value * c) & 0xFFFFFFFF``; shifts of unsigned values are logical."""
    value = value ^ (value >> 16)
    value = value * np.uint32(dropout.MULTIPLIERS[0])
    value = value ^ (value >> 15)
    value = value * np.uint32(dropout.MULTIPLIERS[1])
    return value ^ (value >> 16)


def keep_mask(
    seed: int, step: jax.Array, layer: int, rows: jax.Array, features: int, rate: float
) -> jax.Array:
    """bool [len(rows), features], bit for bit crosstrain.dropout.keep_mask; ``step``
    and ``rows`` are uint32 (the host masks them to 32 bits), so a new step recompiles
    nothing."""
    state = _mix(jnp.asarray(np.uint32(seed & dropout.MASK32)))
    state = _mix(state ^ step.astype(jnp.uint32))
    state = _mix(state ^ np.uint32(layer & dropout.MASK32))
    per_row = _mix(state ^ rows.astype(jnp.uint32)[:, None])
    hashed = _mix(per_row ^ jnp.arange(features, dtype=jnp.uint32)[None, :])
    return (hashed >> (32 - dropout.KEEP_BITS)) >= np.uint32(dropout.threshold(rate))


def build_dropout(node: Node) -> Apply:
    layer = layer_of(node, Dropout)
    rate, features = layer.rate, layer.mask_units(node.input_shape)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = single(inputs)
        if env.train is None or rate == 0.0:
            return x
        keep = keep_mask(env.seed, env.train.step, node.index, env.train.rows, features, rate)
        # (x * keep) * (1 / (1 - rate)), in that order, as the spec rounds it
        shape = (x.shape[0],) + (1,) * (x.ndim - 1) if layer.per_row else x.shape
        return (x * keep.reshape(shape).astype(x.dtype)) * (1.0 / (1.0 - rate))

    return apply


def build_layer_scale(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = single(inputs)
        return x * env.param(f"{node.path}.scale").astype(x.dtype)

    return apply
