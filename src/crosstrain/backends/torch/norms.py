"""The normalisation nodes: layer norm, batch norm (its masked form and torch's own), RMS
norm. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.backends.torch.nodes import ForwardContext, NodeModule
from crosstrain.core.model.graph import Node
from crosstrain.core.model.layers import (
    BatchNorm,
    LayerNorm,
    RMSNorm,
)


class LayerNormNode(NodeModule):
    def __init__(self, layer: LayerNorm, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(node.input_shape[-1], eps=layer.eps)

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.norm(inputs[0])  # type: ignore[no-any-return]


class BatchNormNode(NodeModule):
    """Batch statistics over the real rows of the whole micro-batch on every process
    (an all-reduce of the sums: SyncBatchNorm is CUDA-only and counts padding rows), the
    running statistics as buffers. The features are the last axis, or axis 1 of an NCHW
    image (``channels_first``).

    Where every row is real and one process trains (``context.weight`` None), this is
    torch's own batch norm, the same statistics and gradient in fewer, fused kernels.
    Otherwise (padding rows, several processes) the statistics come from one pass over x
    (each row's mean and variance, combined over the rows by their weights: Chan's formula,
    as stable as two passes), accumulated in the weights' dtype (float32 under autocast, or
    float64) while x is read in its own; the output is x's dtype, and the backward is batch
    norm's closed form (:class:`_MaskedBatchNorm`), not autograd's many passes through the formula."""

    def __init__(self, layer: BatchNorm, node: Node, channels_first: bool) -> None:
        super().__init__()
        features = node.input_shape[-1]
        rank = len(node.input_shape) + 1
        channel = 1 if channels_first else rank - 1
        self.momentum, self.epsilon = layer.momentum, layer.epsilon
        #: the axes statistics reduce, and those within one row
        self.axes = tuple(axis for axis in range(rank) if axis != channel)
        self.row_axes = self.axes[1:]
        #: how a per-feature vector broadcasts over x
        self.per_feature = (features, *[1] * (rank - 1 - channel))
        #: values per feature in one row (its positions: height x width for an image)
        self.positions = math.prod(node.input_shape[:-1])
        #: torch's own batch norm reads the features on axis 1
        self.native = channel == 1
        # absent under Keras's scale=False / center=False
        self.scale = nn.Parameter(torch.ones(features)) if layer.scale else None
        self.offset = nn.Parameter(torch.zeros(features)) if layer.center else None
        self.moving_mean: torch.Tensor
        self.moving_variance: torch.Tensor
        self.register_buffer("moving_mean", torch.zeros(features))
        self.register_buffer("moving_variance", torch.ones(features))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0]
        if not self.training:
            inverse = torch.rsqrt(self.moving_variance + self.epsilon)
            y = _normalise(x, self.moving_mean, inverse, self.scale, self.offset, self.per_feature)
            return y.to(x.dtype)
        # (torch's needs two values of each feature; a one-row batch of vectors has one)
        if context.weight is None and not context.distributed and self.native and x[:, 0].numel() > 1:
            # every row real, one process: torch's own batch norm is this one's statistics
            # and gradient (its running variance unbiased too), in fewer, fused kernels
            return F.batch_norm(
                x, self.moving_mean, self.moving_variance, self.scale, self.offset,
                True, 1 - self.momentum, self.epsilon,
            )  # fmt: skip
        weight = (
            torch.ones(x.shape[0], dtype=self.moving_mean.dtype, device=x.device)
            if context.weight is None
            else context.weight.to(self.moving_mean.dtype)
        )
        mean, variance, count = self._batch_statistics(x.detach(), weight, context.distributed)
        self._move(mean, variance, count)
        inverse = torch.rsqrt(variance + self.epsilon)
        divisor = torch.clamp(count, min=1)
        normalised: torch.Tensor = _MaskedBatchNorm.apply(  # type: ignore[no-untyped-call]
            x,
            mean,
            inverse,
            self.scale,
            self.offset,
            weight / divisor,
            self.axes,
            self.per_feature,
            context.distributed,
        )
        return normalised

    @torch.no_grad()
    def _batch_statistics(
        self, x: torch.Tensor, weight: torch.Tensor, distributed: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mean and biased variance over the real rows of every process, and their count
        (a micro-batch of padding only, the end of an epoch under accumulation, counts 0:
        its statistics divide by 1, not 0)."""
        rows = x.to(weight.dtype)  # fused into the reduction's read under torch.compile
        if self.row_axes:
            row_variance, row_mean = torch.var_mean(rows, dim=self.row_axes, correction=0)
        else:  # [batch, features]: a row is one value per feature
            row_variance, row_mean = torch.zeros_like(rows), rows
        per_row = weight[:, None] * self.positions  # each row's share of the count
        first = torch.cat([(per_row * row_mean).sum(0), per_row.sum().reshape(1)])
        first = _all_reduced(first) if distributed else first
        count = first[-1]
        mean = first[:-1] / torch.clamp(count, min=1)
        spread = (per_row * (row_variance + (row_mean - mean) ** 2)).sum(0)
        spread = _all_reduced(spread) if distributed else spread
        return mean, spread / torch.clamp(count, min=1), count

    @torch.no_grad()
    def _move(self, mean: torch.Tensor, variance: torch.Tensor, count: torch.Tensor) -> None:
        """The running statistics, moved only by a micro-batch with real rows (no host sync:
        ``where``, which a CUDA graph captures)."""
        unbiased = variance * (count / torch.clamp(count - 1, min=1))
        moved = count > 0
        new_mean = self.momentum * self.moving_mean + (1 - self.momentum) * mean
        new_variance = self.moving_variance * self.momentum + (1 - self.momentum) * unbiased
        self.moving_mean.copy_(torch.where(moved, new_mean, self.moving_mean))
        self.moving_variance.copy_(torch.where(moved, new_variance, self.moving_variance))


def _normalise(
    x: torch.Tensor,
    mean: torch.Tensor,
    inverse: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """``(x - mean) * inverse * scale + offset`` in the statistics' dtype."""
    y = (x.to(mean.dtype) - mean.reshape(shape)) * inverse.reshape(shape)
    if scale is not None:
        y = y * scale.reshape(shape)
    if offset is not None:
        y = y + offset.reshape(shape)
    return y


class _MaskedBatchNorm(torch.autograd.Function):
    """Normalises x by statistics of its rows of weight w (the row mask over the count N,
    ``share`` = w / N), and differentiates them with respect to x in closed form. With
    x̂ = (x - mean) * inverse and g the output's gradient, summed over every position of
    every row (padding rows too: their output depends on the statistics) and, distributed,
    over every process (their losses depend on these statistics as well):

        dx = scale * inverse * (g - share * (sum(g) + x̂ * sum(g * x̂)))

    the gradient of the mean and of the variance through autograd, folded. The scale's and
    offset's gradients are this process's sum(g * x̂) and sum(g), which DDP averages."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        mean: torch.Tensor,
        inverse: torch.Tensor,
        scale: torch.Tensor | None,
        offset: torch.Tensor | None,
        share: torch.Tensor,
        axes: tuple[int, ...],
        shape: tuple[int, ...],
        distributed: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, mean, inverse, scale, share)
        ctx.axes, ctx.shape, ctx.distributed = axes, shape, distributed
        return _normalise(x, mean, inverse, scale, offset, shape).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, inverse, scale, share = ctx.saved_tensors
        shape = ctx.shape
        g = grad.to(mean.dtype)
        normed = (x.to(mean.dtype) - mean.reshape(shape)) * inverse.reshape(shape)
        grad_offset = g.sum(ctx.axes)
        grad_scale = (g * normed).sum(ctx.axes)
        sums = torch.cat([grad_offset, grad_scale])
        total, total_normed = (_all_reduced(sums) if ctx.distributed else sums).chunk(2)
        gain = inverse if scale is None else inverse * scale
        row_share = share.reshape(-1, *[1] * (x.dim() - 1))
        centred = row_share * (total.reshape(shape) + normed * total_normed.reshape(shape))
        grad_x = (gain.reshape(shape) * (g - centred)).to(x.dtype)
        return (
            grad_x,
            None,
            None,
            grad_scale if scale is not None else None,
            grad_offset if ctx.needs_input_grad[4] else None,
            None,
            None,
            None,
            None,
        )


def _all_reduced(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over processes (a copy: the input is left as it is)."""
    import torch.distributed as dist

    total = tensor.clone()
    dist.all_reduce(total)
    return total


class RMSNormNode(NodeModule):
    """docs/layers.md's RMS norm of the last axis, in the weights' dtype (fp32 under bf16 and
    fp16, as batch norm)."""

    def __init__(self, layer: RMSNorm, node: Node, channels_first: bool) -> None:
        super().__init__()
        self.epsilon = layer.epsilon
        self.scale = nn.Parameter(torch.ones(node.input_shape[-1]))

    def forward(self, inputs: list[torch.Tensor], context: ForwardContext) -> torch.Tensor:
        x = inputs[0].to(self.scale.dtype)  # the weights' dtype: float32 under autocast, or float64
        normed = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.epsilon)
        return (normed * self.scale).to(inputs[0].dtype)
