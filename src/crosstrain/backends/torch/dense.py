"""The dense family's nodes: dense (tied to an embedding or not), dropout (crosstrain's
hashed masks), layer scale and rescale. What each computes is specified in docs/layers.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.backends.torch.nodes import ForwardContext, NodeModule, UnaryNode
from crosstrain.backends.torch.sequences import EmbeddingNode
from crosstrain.core.model import dropout as neutral_dropout
from crosstrain.core.model.graph import Node
from crosstrain.core.model.layers import (
    Dense,
    Dropout,
    LayerScale,
    Rescale,
)


class DenseNode(NodeModule):
    def __init__(self, layer: Dense, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(node.input_shape[-1], layer.units, bias=layer.use_bias)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        # the function, not the submodule's call: a small model's step is bound by the
        # host's Python, and the weights keep their ``linear.*`` names
        return F.linear(inputs[0], self.linear.weight, self.linear.bias)


class LayerScaleNode(NodeModule):
    """``x * scale`` over the last axis, the scale cast to the input's dtype (as Keras casts
    its LayerScale's weight to the compute dtype)."""

    def __init__(self, layer: LayerScale, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(node.input_shape[-1]))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return inputs[0] * self.scale.to(inputs[0].dtype)


def rescale_node(layer: Rescale, node: Node, channels_first: bool) -> NodeModule:
    scale, offset = layer.scale, layer.offset
    if isinstance(scale, tuple) or isinstance(offset, tuple):
        return PerChannelRescaleNode(layer, channels_first)
    return UnaryNode(lambda x: x * scale + offset)


class PerChannelRescaleNode(NodeModule):
    """``x * scale + offset`` with vectors over the channels (axis 1 of an NCHW image), cast
    to the input's dtype first, as Keras's Rescaling casts them to its compute dtype."""

    scale: torch.Tensor
    offset: torch.Tensor

    def __init__(self, layer: Rescale, channels_first: bool) -> None:
        super().__init__()
        shape = (-1, 1, 1) if channels_first else (-1,)
        for name in ("scale", "offset"):
            value = torch.as_tensor(getattr(layer, name), dtype=torch.float32)
            self.register_buffer(name, value.reshape(shape) if value.dim() else value, persistent=False)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        return x * self.scale.to(x.dtype) + self.offset.to(x.dtype)


class DropoutNode(NodeModule):
    """Masks from crosstrain's counter-based hash, in torch's int64 ops (see core.dropout).
    The hash numbers a row's units in the neutral (NHWC) order; on an NCHW image
    (``channels_first``) the mask is drawn in NCHW order from those same numbers."""

    def __init__(self, layer: Dropout, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.rate, self.layer_index = layer.rate, node.index
        self.features = layer.mask_units(node.input_shape)
        self.per_row = layer.per_row
        self.channels_first = channels_first and not layer.per_row  # one unit a row has no order
        self.neutral_shape = node.input_shape

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        if not self.training or self.rate == 0.0:
            return x
        assert context.rows is not None, "dropout trains on row positions"
        units = None
        if self.channels_first:  # unit c, h, w of the NCHW row is unit h, w, c of the neutral
            numbers = torch.arange(self.features, device=x.device).reshape(self.neutral_shape)
            units = numbers.permute(2, 0, 1).reshape(-1)
        keep: torch.Tensor = keep_mask(
            context.seed, context.step, self.layer_index, context.rows, self.features, self.rate, units
        )
        shape = (x.shape[0],) + (1,) * (x.dim() - 1) if self.per_row else x.shape
        return (x * keep.reshape(shape).to(x.dtype)) * (1.0 / (1.0 - self.rate))


def _mix(value: Any) -> Any:
    """One round of the hash, on an int64 tensor or a Python int below 2**32."""
    first, second = neutral_dropout.MULTIPLIERS
    value = value ^ (value >> 16)
    value = (value * first) & neutral_dropout.MASK32
    value = value ^ (value >> 15)
    value = (value * second) & neutral_dropout.MASK32
    return value ^ (value >> 16)


def keep_mask(
    seed: int,
    step: int | torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    features: int,
    rate: float,
    units: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [rows, features], equal bit for bit to :func:`crosstrain.core.model.dropout.keep_mask`;
    ``units`` (int64 [features]) puts column j at the reference's column ``units[j]``."""
    mask32 = neutral_dropout.MASK32
    device = rows.device
    # the row-independent part on the host, in Python ints: the same low 32 bits as int64
    # ops give, and no scalar copied to the device (which would wait for its stream) per layer;
    # a CUDA graph's replay passes its step counter, and the same ops run on the device
    state = _mix(seed & mask32)
    state = _mix(state ^ (step & mask32))
    state = _mix(state ^ (layer & mask32))
    per_row = _mix(state ^ (rows.to(torch.int64)[:, None] & mask32))
    if units is None:
        units = torch.arange(features, dtype=torch.int64, device=device)
    hashed: torch.Tensor = _mix(per_row ^ units[None, :])
    return (hashed >> (32 - neutral_dropout.KEEP_BITS)) >= neutral_dropout.threshold(rate)


_TRACED_FORWARD = DropoutNode.forward


def run_dropout_eagerly_when_compiled() -> None:
    """Dropout stays eager inside a compiled model (``torch.compiler.disable``, its mask
    included): traced, its frame would be guarded on the node's layer number and recompiled
    for each dropout node, past dynamo's limit, and inductor's C++ code generation on CPU
    promotes the int64 hash to float, changing the mask's bits. Disabling imports
    ``torch._dynamo``, a third of an eager worker's start on CPU, so only a run that compiles
    asks for it, before compiling."""
    if DropoutNode.forward is _TRACED_FORWARD:
        disabled = torch.compiler.disable(_TRACED_FORWARD)  # type: ignore[no-untyped-call]
        setattr(DropoutNode, "forward", disabled)  # noqa: B010


class _BiasOnly(nn.Module):
    """A tied dense's own parameter: its bias, or none."""

    def __init__(self, units: int, use_bias: bool) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(units)) if use_bias else None


class TiedDenseNode(NodeModule):
    """A dense whose kernel is an embedding's table, transposed (``tie``): the graph module
    hands it that embedding's node (:meth:`tie`), read at each forward; its own parameter is
    the bias alone, under the untied dense's name (``linear.bias``)."""

    def __init__(self, layer: Dense, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.linear = _BiasOnly(layer.units, layer.use_bias)
        # a list, so that the embedding is not registered twice (its table stays one
        # parameter of the model, under the embedding's name)
        self.tied: list[EmbeddingNode] = []

    def tie(self, embedding: NodeModule) -> None:
        assert isinstance(embedding, EmbeddingNode), "a dense ties to an embedding"
        self.tied[:] = [embedding]

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        # the table [vocab, units] is nn.Linear's weight layout [out, in] already
        return F.linear(inputs[0], self.tied[0].table.weight, self.linear.bias)


def dense_node(layer: Dense, node: Node, channels_first: bool) -> NodeModule:
    return (
        DenseNode(layer, node, channels_first)
        if node.tied_to is None
        else TiedDenseNode(layer, node, channels_first)
    )
