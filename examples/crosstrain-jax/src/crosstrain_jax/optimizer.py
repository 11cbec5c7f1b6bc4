"""SGD, Adam and AdamW written out with torch's exact formulas (plan.py's OptimizerSpec).

Matching torch operation for operation is what makes per-step losses agree to float
rounding. Scalars that torch computes in Python (double precision) - bias corrections,
step sizes, AdamW's decay factor - are computed on the host here too and passed into
the compiled step as arguments in the weights' dtype (float32; float64 under fp64), exactly
where torch casts them; so the
learning rate changes every step without recompiling.

:data:`OPTIMIZERS` maps each optimizer name this backend speaks to its rule; its keys
are part of the backend's vocabulary, so a plan naming another optimizer is refused
before launch. Weight decay applies to the weights crosstrain's ``decayed_weights`` names
for the plan's ``optimizer.decay``, so every mode of crosstrain's ``DECAY_MODES`` is spoken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import OptimizerSpec

Tree = dict[str, jax.Array]
OptimizerState = dict[str, Tree]
Scalars = dict[str, float]
Update = Callable[
    [OptimizerSpec, Tree, Tree, OptimizerState, Mapping[str, jax.Array], frozenset[str]],
    tuple[Tree, OptimizerState],
]

#: torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
_CLIP_EPS = 1e-6


@attrs.frozen
class OptimizerRule:
    """One optimizer: its zeroed buffers, its per-step host scalars and its traced update."""

    init: Callable[[OptimizerSpec, Mapping[str, jax.Array]], OptimizerState]
    scalars: Callable[[OptimizerSpec, float, int], Scalars]
    update: Update


def init_state(spec: OptimizerSpec, params: Mapping[str, jax.Array]) -> OptimizerState:
    """Zeroed buffers (SGD's momentum buffer, Adam's moments) for the trainable params."""
    return OPTIMIZERS[spec.name].init(spec, params)


def host_scalars(spec: OptimizerSpec, lr: float, step: int) -> Scalars:
    """The per-step scalars torch computes in Python, for optimizer step ``step`` (1-based)."""
    return OPTIMIZERS[spec.name].scalars(spec, lr, step)


def apply_update(
    spec: OptimizerSpec, params: Tree, grads: Tree, state: OptimizerState,
    scalars: Mapping[str, jax.Array], decayed: frozenset[str] | None = None,
) -> tuple[Tree, OptimizerState]:
    """One optimizer step on every trainable parameter (traced inside the compiled step);
    ``weight_decay`` applies to the names in ``decayed`` (None: to every one)."""
    chosen = frozenset(params) if decayed is None else decayed
    return OPTIMIZERS[spec.name].update(spec, params, grads, state, scalars, chosen)


def clip_by_global_norm(grads: Tree, names: Sequence[str], max_norm: float) -> Tree:
    """torch's clip_grad_norm_: norm of the per-tensor norms, coefficient clamped at 1,
    applied always (no branch on the device)."""
    norms = jnp.stack([jnp.linalg.norm(grads[name].ravel()) for name in names])
    total_norm = jnp.linalg.norm(norms)
    coefficient = jnp.minimum(max_norm / (total_norm + _CLIP_EPS), 1.0)
    return {name: grad * coefficient for name, grad in grads.items()}


def as_dtype(scalars: Scalars, dtype: str) -> dict[str, np.floating[Any]]:
    """Host doubles -> arguments in the weights' ``dtype`` (torch casts a Python scalar to
    the tensor's dtype)."""
    return {name: np.dtype(dtype).type(value) for name, value in scalars.items()}


def _zeros(params: Mapping[str, jax.Array]) -> Tree:
    return {name: jnp.zeros_like(value) for name, value in params.items()}


# --------------------------------------------------------------------------- sgd


def _sgd_init(spec: OptimizerSpec, params: Mapping[str, jax.Array]) -> OptimizerState:
    return {"momentum": _zeros(params)} if spec.momentum else {}


def _sgd_scalars(spec: OptimizerSpec, lr: float, step: int) -> Scalars:
    return {"neg_lr": -lr}


def _sgd(
    spec: OptimizerSpec, params: Tree, grads: Tree, state: OptimizerState,
    scalars: Mapping[str, jax.Array], decayed: frozenset[str],
) -> tuple[Tree, OptimizerState]:
    new_params, new_buffers = {}, {}
    for name, param in params.items():
        grad = grads[name]
        if spec.weight_decay and name in decayed:
            grad = grad + spec.weight_decay * param  # grad.add(param, alpha=wd)
        if spec.momentum:
            # buf.mul_(m).add_(grad); the first step's zero buffer gives torch's buf = grad
            buffer = state["momentum"][name] * spec.momentum + grad
            new_buffers[name] = buffer
            grad = grad + spec.momentum * buffer if spec.nesterov else buffer
        new_params[name] = param + scalars["neg_lr"] * grad  # param.add_(grad, alpha=-lr)
    return new_params, ({"momentum": new_buffers} if spec.momentum else {})


# --------------------------------------------------------------------------- adam, adamw


def _adam_init(spec: OptimizerSpec, params: Mapping[str, jax.Array]) -> OptimizerState:
    return {"exp_avg": _zeros(params), "exp_avg_sq": _zeros(params)}


def _adam_scalars(spec: OptimizerSpec, lr: float, step: int) -> Scalars:
    bias_correction1 = 1 - spec.beta1**step
    bias_correction2 = 1 - spec.beta2**step
    return {
        "neg_step_size": -(lr / bias_correction1),
        "bias_correction2_sqrt": bias_correction2**0.5,
    }


def _adamw_scalars(spec: OptimizerSpec, lr: float, step: int) -> Scalars:
    return {**_adam_scalars(spec, lr, step), "decay_factor": 1 - lr * spec.weight_decay}


def _lerp(start: jax.Array, end: jax.Array, weight: float) -> jax.Array:
    """torch.lerp's two-sided formula, which keeps the result exact at either end."""
    if weight < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1 - weight)


def _adam_step(
    decoupled: bool, spec: OptimizerSpec, params: Tree, grads: Tree, state: OptimizerState,
    scalars: Mapping[str, jax.Array], decayed: frozenset[str],
) -> tuple[Tree, OptimizerState]:
    new_params, exp_avgs, exp_avg_sqs = {}, {}, {}
    for name, param in params.items():
        grad = grads[name]
        decays = spec.weight_decay and name in decayed
        if decays and decoupled:
            param = param * scalars["decay_factor"]  # param.mul_(1 - lr * wd)
        elif decays:
            grad = grad + spec.weight_decay * param
        exp_avg = _lerp(state["exp_avg"][name], grad, 1 - spec.beta1)
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg_sq = state["exp_avg_sq"][name] * spec.beta2 + (1 - spec.beta2) * grad * grad
        denom = jnp.sqrt(exp_avg_sq) / scalars["bias_correction2_sqrt"] + spec.eps
        # param.addcdiv_(exp_avg, denom, value=-step_size)
        new_params[name] = param + scalars["neg_step_size"] * exp_avg / denom
        exp_avgs[name], exp_avg_sqs[name] = exp_avg, exp_avg_sq
    return new_params, {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}


def _adam(
    spec: OptimizerSpec, params: Tree, grads: Tree, state: OptimizerState,
    scalars: Mapping[str, jax.Array], decayed: frozenset[str],
) -> tuple[Tree, OptimizerState]:
    """L2 weight decay added to the gradient (torch.optim.Adam)."""
    return _adam_step(False, spec, params, grads, state, scalars, decayed)


def _adamw(
    spec: OptimizerSpec, params: Tree, grads: Tree, state: OptimizerState,
    scalars: Mapping[str, jax.Array], decayed: frozenset[str],
) -> tuple[Tree, OptimizerState]:
    """Decoupled weight decay (torch.optim.AdamW)."""
    return _adam_step(True, spec, params, grads, state, scalars, decayed)


#: the optimizers this backend speaks: the keys are its vocabulary's optimizer names
OPTIMIZERS: dict[str, OptimizerRule] = {
    "sgd": OptimizerRule(_sgd_init, _sgd_scalars, _sgd),
    "adam": OptimizerRule(_adam_init, _adam_scalars, _adam),
    "adamw": OptimizerRule(_adam_init, _adamw_scalars, _adamw),
}
