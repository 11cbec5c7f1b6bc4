"""The sequence nodes: token and position embeddings, attention, the class token and the
padding mask. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.backends.torch.nodes import ForwardContext, NodeModule
from crosstrain.core.model.graph import Node
from crosstrain.core.model.layers import (
    Attention,
    ClassToken,
    Embedding,
    PaddingMask,
    PositionEmbedding,
)
from crosstrain.core.model.layers.sequences import rotary_tables


class EmbeddingNode(NodeModule):
    def __init__(self, layer: Embedding, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(layer.vocab_size, layer.units)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.table(inputs[0].long())  # type: ignore[no-any-return]


class PositionEmbeddingNode(NodeModule):
    def __init__(self, layer: PositionEmbedding, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(*node.input_shape))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0] + self.table


class AttentionNode(NodeModule):
    """Multi-head self-attention with torch's scaled_dot_product_attention (softmax in fp32
    for fp32 inputs; the fused kernels accumulate low-precision inputs in fp32). Grouped
    keys and values are repeated to every query head of their group; rotary embedding turns
    queries and keys by core's tables; a padding mask (the second input) adds -1e9 to the
    scores of padded keys."""

    def __init__(self, layer: Attention, node: Node, channels_first: bool) -> None:
        super().__init__()
        length, units = node.input_shape
        self.heads, self.causal = layer.heads, layer.causal
        self.head_units = units // layer.heads
        self.groups = layer.heads // layer.key_heads
        key_units = self.head_units * layer.key_heads
        bias = layer.use_bias
        self.query, self.output = (nn.Linear(units, units, bias=bias) for _ in range(2))
        self.key, self.value = (nn.Linear(units, key_units, bias=bias) for _ in range(2))
        self.rotary = layer.rotary
        cos, sin = rotary_tables(length, self.head_units, layer.rotary_base)
        # constants of the plan, not weights: kept out of the state dict
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        batch, length, units = x.shape

        def split(projection: nn.Linear) -> torch.Tensor:
            projected: torch.Tensor = projection(x)
            return projected.reshape(batch, length, -1, self.head_units).transpose(1, 2)

        query, key, value = split(self.query), split(self.key), split(self.value)
        if self.rotary:
            query, key = self._rotate(query), self._rotate(key)
        if self.groups > 1:  # key/value head j serves query heads j*groups .. j*groups+groups-1
            key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        if len(inputs) == 1:
            attended = F.scaled_dot_product_attention(query, key, value, is_causal=self.causal)
        else:
            mask = self._score_bias(inputs[1], length, query.dtype)
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return self.output(attended.transpose(1, 2).reshape(batch, length, units))  # type: ignore[no-any-return]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, heads, length, head units] turned by the rotary tables (half-split)."""
        half = self.head_units // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos.to(x.dtype) + turned * self.sin.to(x.dtype)

    def _score_bias(self, padding: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """What SDPA adds to the scores [batch, 1, query, key]: -1e9 for a padded key, and
        -inf for a later one when causal (SDPA takes a mask or is_causal, not both)."""
        bias = ((padding.to(dtype) - 1) * 1e9)[:, None, None, :]
        if self.causal:
            later = torch.ones(length, length, dtype=torch.bool, device=padding.device).triu(1)
            bias = bias.masked_fill(later, -math.inf)
        return bias


class ClassTokenNode(NodeModule):
    def __init__(self, layer: ClassToken, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, node.input_shape[-1]))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        return torch.cat([self.token.to(x.dtype).expand(x.shape[0], 1, x.shape[2]), x], dim=1)


def padding_mask(layer: PaddingMask) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: (ids != layer.pad_id).float()
