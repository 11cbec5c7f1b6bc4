"""Neutral layers as a pure jax.numpy function, and the per-row losses.

jax is channels-last like the neutral layout, so nothing is converted at the edge:
parameters keep their neutral names (``{layer_name}.{param}``) and shapes (Dense
kernel [in, out], Conv2D kernel [kh, kw, in, out] = XLA's HWIO), images stay NHWC,
and Flatten is a plain reshape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from crosstrain.core.errors import PlanError
from crosstrain.core.layers import (
    GELU,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    Layer,
    LayerNorm,
    MaxPool2D,
    ReLU,
    Tanh,
    layer_name,
)
from crosstrain.core.plan import Plan
from jax import lax

from crosstrain_jax.optimizer import OptimizerState, Tree, apply_update, clip_by_global_norm

Params = Mapping[str, jax.Array]
#: forward(params, x, dropout_key) -> float32 outputs; a None key means evaluation (no dropout)
Forward = Callable[[Params, jax.Array, jax.Array | None], jax.Array]

_COMPUTE_DTYPES: dict[str, np.dtype[Any]] = {"fp32": np.dtype(np.float32),
                                             "bf16": np.dtype(jnp.bfloat16)}


def compute_dtype(plan: Plan) -> np.dtype[Any]:
    """fp32, or bf16 with float32 master weights; fp16 would need a loss scaler, which this
    example leaves out."""
    dtype = _COMPUTE_DTYPES.get(plan.train.precision)
    if dtype is None:
        raise PlanError(
            f"precision {plan.train.precision!r} is not supported by the jax backend "
            f"(use 'fp32' or 'bf16')",
            field="train.precision", source=plan.source,
        )
    return dtype


def build_forward(plan: Plan) -> Forward:
    """The plan's model as forward(params, x, key). Native models are not supported here."""
    if plan.model.native is not None:
        raise PlanError("the jax backend builds models from neutral layers only; "
                        "model.native is not supported", field="model.native", source=plan.source)
    dtype = compute_dtype(plan)
    # Full float32 matmuls in fp32 runs: GPUs would otherwise use TF32 and lose parity.
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    named = [(layer_name(layer, index), layer) for index, layer in enumerate(plan.model.layers)]

    def forward(params: Params, x: jax.Array, key: jax.Array | None) -> jax.Array:
        x = x.astype(dtype)
        for index, (name, layer) in enumerate(named):
            layer_key = None if key is None else jax.random.fold_in(key, index)
            x = _apply(layer, name, params, x, layer_key, dtype, precision)
        return x.astype(jnp.float32)

    return forward


def _param(params: Params, name: str, dtype: np.dtype[Any]) -> jax.Array:
    # bf16 runs cast the float32 master weights here; the gradient flows back in float32.
    return params[name].astype(dtype)


def _apply(
    layer: Layer,
    name: str,
    params: Params,
    x: jax.Array,
    key: jax.Array | None,
    dtype: np.dtype[Any],
    precision: lax.Precision,
) -> jax.Array:
    if isinstance(layer, Dense):
        y = jnp.matmul(x, _param(params, f"{name}.kernel", dtype), precision=precision)
        return y + _param(params, f"{name}.bias", dtype) if layer.use_bias else y
    if isinstance(layer, Conv2D):
        y = lax.conv_general_dilated(
            x, _param(params, f"{name}.kernel", dtype),
            window_strides=(layer.strides, layer.strides), padding=layer.padding.upper(),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=precision,
        )
        return y + _param(params, f"{name}.bias", dtype) if layer.use_bias else y
    if isinstance(layer, MaxPool2D):
        size, stride = layer.pool_size, layer.effective_strides
        pooled: jax.Array = lax.reduce_window(x, -jnp.inf, lax.max, (1, size, size, 1),
                                              (1, stride, stride, 1), "VALID")
        return pooled
    if isinstance(layer, Flatten):
        return x.reshape(x.shape[0], -1)  # already channels-last: the neutral order
    if isinstance(layer, LayerNorm):
        return _layer_norm(x, params[f"{name}.scale"], params[f"{name}.offset"], layer.eps)
    if isinstance(layer, Dropout):
        return x if key is None else _dropout(x, layer.rate, key)
    if isinstance(layer, ReLU):
        return jnp.where(x > 0, x, 0)  # gradient 0 at 0, as torch's (jnp.maximum splits it)
    if isinstance(layer, GELU):
        return jax.nn.gelu(x, approximate=False)
    if isinstance(layer, Tanh):
        return jnp.tanh(x)
    raise PlanError(f"layer type {layer.type!r} is not supported by the jax backend")


def _layer_norm(x: jax.Array, scale: jax.Array, offset: jax.Array, eps: float) -> jax.Array:
    """Over the last axis, in float32 even in bf16 runs (as torch's autocast does)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    variance = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
    normed = (x32 - mean) * lax.rsqrt(variance + eps)
    return (normed * scale + offset).astype(x.dtype)


def _dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    if rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def per_row_loss(name: str, outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Loss of each row, in float32: cross-entropy on logits, or MSE averaged over outputs."""
    outputs = outputs.astype(jnp.float32)
    if name == "cross_entropy":
        log_probs = jax.nn.log_softmax(outputs, axis=1)
        return -jnp.take_along_axis(log_probs, targets[:, None].astype(jnp.int32), axis=1)[:, 0]
    return jnp.square(outputs - targets).mean(axis=1)


def parameter_count(params: Params) -> int:
    return sum(int(value.size) for value in params.values())


# --------------------------------------------------------------------------- compiled steps


def make_train_step(plan: Plan, forward: Forward, names: Sequence[str]) -> Callable[..., Any]:
    """train_step(params, optimizer_state, xs, ys, ws, scale, scalars, key) -> (params,
    optimizer_state, micro_sums), to be jitted.

    ``xs``/``ys``/``ws`` stack the step's micro-batches on axis 0; their batch axis is
    sharded over the devices, so XLA sums each gradient across devices (DESIGN rule 4:
    every micro-batch loss is sum(weight * loss) * ``scale``, scale = 1 / global real rows).
    """
    loss_name, spec, clip = plan.loss.name, plan.optimizer, plan.train.clip_grad_norm

    def micro_loss(
        params: Params, x: jax.Array, y: jax.Array, weight: jax.Array, scale: jax.Array,
        key: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        micro_sum = (per_row_loss(loss_name, forward(params, x, key), y) * weight).sum()
        return micro_sum * scale, micro_sum

    gradient = jax.grad(micro_loss, has_aux=True)

    def train_step(
        params: Tree, optimizer_state: OptimizerState, xs: jax.Array, ys: jax.Array, ws: jax.Array,
        scale: jax.Array, scalars: Mapping[str, jax.Array], key: jax.Array,
    ) -> tuple[Tree, OptimizerState, jax.Array]:
        def accumulate(total: Tree, micro: tuple[jax.Array, ...]) -> tuple[Tree, jax.Array]:
            x, y, weight, index = micro
            grads, micro_sum = gradient(params, x, y, weight, scale, jax.random.fold_in(key, index))
            return {name: total[name] + grads[name] for name in total}, micro_sum

        zeros = {name: jnp.zeros_like(value) for name, value in params.items()}
        micro_steps = jnp.arange(xs.shape[0])
        grads, micro_sums = lax.scan(accumulate, zeros, (xs, ys, ws, micro_steps))
        if clip is not None:
            grads = clip_by_global_norm(grads, names, clip)
        new_params, new_state = apply_update(spec, params, grads, optimizer_state, scalars)
        return new_params, new_state, micro_sums

    return train_step


def make_eval_step(plan: Plan, forward: Forward) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """eval_step(params, x, y) -> (per-row loss, per-row correct), to be jitted. The host sums
    them in float64, in row order, so the totals do not depend on the device count."""
    loss_name = plan.loss.name

    def eval_step(params: Params, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        outputs = forward(params, x, None)
        losses = per_row_loss(loss_name, outputs, y)
        if loss_name != "cross_entropy":
            return losses, jnp.zeros_like(losses)
        return losses, (jnp.argmax(outputs, axis=1) == y).astype(jnp.float32)

    return eval_step
