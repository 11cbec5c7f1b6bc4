"""The optimizer of the torch backend: torch.optim, whose semantics a plan's optimizer means."""

from __future__ import annotations

import torch

from crosstrain.core.plan import OptimizerSpec


def make_optimizer(module: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    params = list(module.parameters())
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov, weight_decay=spec.weight_decay
        )
    betas = (spec.beta1, spec.beta2)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=betas, eps=spec.eps, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, betas=betas, eps=spec.eps, weight_decay=spec.weight_decay)
