"""What every torch node module shares: the :class:`ForwardContext` a training forward
reads, the :class:`NodeModule` base, the image orders (:class:`Order`) and the permutations
between them (layers.py explains why images run in NCHW between the nodes that can)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn


class ForwardContext(NamedTuple):
    """What a training forward needs beyond the inputs: the row mask (1 real, 0 padding;
    None when every row is real), each row's position in the global batch, the optimizer
    step, the plan's seed, and whether batch statistics are summed across processes. (A NamedTuple, not attrs:
    torch.compile traces through a tuple, not through attrs' frozen ``__setattr__``.)"""

    weight: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    step: int | torch.Tensor = 0  # a device counter when the step is a CUDA graph's replay
    seed: int = 0
    distributed: bool = False


class NodeModule(nn.Module):
    """A graph node: ``forward(inputs, context)``."""

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        raise NotImplementedError


class UnaryNode(NodeModule):
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.function(inputs[0])


def to_nchw(x: torch.Tensor) -> torch.Tensor:
    """NHWC -> NCHW in torch's channels-last memory format: the same bytes (a view, no copy,
    when the NHWC tensor is contiguous), which CPU (oneDNN) and GPU (cuDNN) convolutions run
    natively and elementwise ops keep. The model's convolution weights are channels-last
    too (`build_module`), so their gradients match them (DDP's buckets copy and
    warn about a gradient laid out unlike its weight)."""
    return x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)


def to_nhwc(x: torch.Tensor) -> torch.Tensor:
    """NCHW -> the neutral NHWC, as a view: what reads it next (flatten's reshape, a dense
    layer's matmul, the loss) copies or reads it as it needs."""
    return x.permute(0, 2, 3, 1)


class Order(enum.Enum):
    """How a layer type works on an image (a 4-D tensor); other tensors are always neutral."""

    #: reads and writes NCHW: its 4-D inputs are permuted to NCHW first
    CHANNELS_FIRST = "channels_first"
    #: works in the order of its inputs and writes its output in it (inputs in both orders:
    #: the NHWC ones are permuted to NCHW)
    EITHER = "either"
    #: reads either order; its output has no spatial axes, so no order
    REDUCES = "reduces"
    #: reads NHWC, the neutral order: what it computes depends on the order of the elements
    NEUTRAL = "neutral"
