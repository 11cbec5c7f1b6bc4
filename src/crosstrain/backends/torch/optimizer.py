"""The optimizer of the torch backend: torch.optim, whose semantics a plan's optimizer means."""

from __future__ import annotations

from collections.abc import Callable

import torch

from crosstrain.core.plan import OptimizerSpec

Params = list[torch.nn.Parameter]


def _sgd(params: Params, spec: OptimizerSpec, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params,
        lr=spec.lr,
        momentum=spec.momentum,
        nesterov=spec.nesterov,
        weight_decay=spec.weight_decay,
        fused=fused or None,
    )


def _adam(params: Params, spec: OptimizerSpec, fused: bool) -> torch.optim.Optimizer:
    betas = (spec.beta1, spec.beta2)
    return torch.optim.Adam(
        params, lr=spec.lr, betas=betas, eps=spec.eps, weight_decay=spec.weight_decay, fused=fused or None
    )


def _adamw(params: Params, spec: OptimizerSpec, fused: bool) -> torch.optim.Optimizer:
    betas = (spec.beta1, spec.beta2)
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=betas, eps=spec.eps, weight_decay=spec.weight_decay, fused=fused or None
    )


#: core optimizer name -> its torch.optim builder (``fused``: one kernel for every parameter)
OPTIMIZERS: dict[str, Callable[[Params, OptimizerSpec, bool], torch.optim.Optimizer]] = {
    "sgd": _sgd,
    "adam": _adam,
    "adamw": _adamw,
}


def make_optimizer(
    module: torch.nn.Module, spec: OptimizerSpec, fused: bool = False
) -> torch.optim.Optimizer:
    """The plan's optimizer over the trainable parameters (batch norm's running statistics
    are buffers, never optimized); ``fused`` on CUDA under ``train.compile``."""
    return OPTIMIZERS[spec.name](list(module.parameters()), spec, fused)
