"""The sequence nodes: token and position embeddings, attention, the class token, take and
the padding mask. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import (
    Attention,
    Node,
    PaddingMask,
    Take,
    rotary_tables,
)

from crosstrain_jax.nodes import Apply, Env, layer_of, single


def build_embedding(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # int32 ids [batch, length] -> [batch, length, units]; the gradient scatter-adds
        return jnp.take(env.param(f"{node.path}.table"), single(inputs), axis=0)

    return apply


def build_position_embedding(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return single(inputs) + env.param(f"{node.path}.table")  # broadcast over the batch

    return apply


def build_attention(node: Node) -> Apply:
    layer = layer_of(node, Attention)
    length, units = node.input_shape
    heads, head_units = layer.heads, units // layer.heads
    groups = heads // layer.key_heads
    # True where query position i may see key position j
    visible = np.tril(np.ones((length, length), bool)) if layer.causal else None
    cos, sin = rotary_tables(length, head_units, layer.rotary_base)  # [length, head units]

    def rotate(value: jax.Array) -> jax.Array:
        """[batch, length, heads, head units] turned by the tables (the half-split pairs)."""
        half = head_units // 2
        turned = jnp.concatenate([-value[..., half:], value[..., :half]], axis=-1)
        return value * cos[:, None, :].astype(value.dtype) + turned * sin[:, None, :].astype(
            value.dtype
        )

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = inputs[0]

        def project(name: str, value: jax.Array) -> jax.Array:
            kernel = env.param(f"{node.path}.{name}_kernel")
            y = jnp.matmul(value, kernel, precision=env.compute.matmul)
            return y + env.param(f"{node.path}.{name}_bias") if layer.use_bias else y

        def split(value: jax.Array) -> jax.Array:  # head h takes units h*d .. h*d+d
            return value.reshape(x.shape[0], length, -1, head_units)

        query, key, value = (split(project(name, x)) for name in ("query", "key", "value"))
        if layer.rotary:
            query, key = rotate(query), rotate(key)
        if groups > 1:  # key/value head j serves query heads j*groups .. j*groups+groups-1
            key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
        scores = jnp.einsum(
            "bqhd,bkhd->bhqk",
            query,
            key,
            precision=env.compute.matmul,
            preferred_element_type=env.compute.full,
        ) / math.sqrt(head_units)
        if len(inputs) > 1:  # the padding mask: -1e9 on a padded key's scores
            scores = scores + ((inputs[1].astype(env.compute.full) - 1) * 1e9)[:, None, None, :]
        if visible is not None:
            scores = jnp.where(visible, scores, -jnp.inf)
        probabilities = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # softmax in fp32
        joined = jnp.einsum(
            "bhqk,bkhd->bqhd", probabilities, value, precision=env.compute.matmul
        ).reshape(x.shape)
        return project("output", joined)

    return apply


def build_class_token(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = single(inputs)
        token = env.param(f"{node.path}.token").astype(x.dtype)  # [1, units]
        return jnp.concatenate([jnp.broadcast_to(token, (x.shape[0], *token.shape)), x], axis=1)

    return apply


def build_take(node: Node) -> Apply:
    index = layer_of(node, Take).index

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return single(inputs)[:, index]

    return apply


def build_padding_mask(node: Node) -> Apply:
    pad_id = layer_of(node, PaddingMask).pad_id

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return (single(inputs) != pad_id).astype(env.compute.dtype)

    return apply
