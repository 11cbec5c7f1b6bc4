"""The plan's model graph as a pure jax.numpy function, the losses, and the compiled steps.

Every name this backend speaks is a key of a table: :data:`LOSSES` and :data:`METRIC_COUNTS`
here, ``LAYERS`` in :mod:`crosstrain_jax.layers` (one builder per layer type, in layers.py,
dense.py, norms.py and sequences.py), ``PRECISIONS`` in :mod:`crosstrain_jax.nodes` and
``OPTIMIZERS`` in :mod:`crosstrain_jax.optimizer`; the keys are
the backend's vocabulary, which crosstrain checks a plan against before launch. There is
no fallback: a name outside the tables never reaches this module.

jax is channels-last like the neutral layout, so nothing is converted at the edge:
weights keep their neutral names (``{node.path}.{param}``) and shapes (Dense kernel
[in, out], Conv2D kernel [kh, kw, in, out] = XLA's HWIO), images stay NHWC, and Flatten
is a plain reshape. What each layer computes is docs/layers.md's spec.

The batch axis of every array is sharded over the devices, and every expression below
is written over the *global* batch: a sum over rows (the loss, batch norm's statistics)
is already a sum over all replicas; XLA inserts the all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import (
    MODEL_INPUT,
    Plan,
    decayed_weights,
)
from jax import lax

from crosstrain_jax.layers import LAYERS
from crosstrain_jax.nodes import (
    PRECISIONS,
    Env,
    Forward,
    Params,
    TrainInputs,
)
from crosstrain_jax.optimizer import OptimizerState, Tree, apply_update, clip_by_global_norm

#: what the accumulation scan carries: (summed gradients, moving statistics so far)
Carry = tuple[Tree, Tree]


def build_forward(plan: Plan) -> Forward:
    """The plan's model graph as one function; every node is built by its type's LAYERS entry."""
    graph = plan.model.graph(plan.source)
    compute = PRECISIONS[plan.train.precision]
    steps = [(node, LAYERS[node.layer.type](node)) for node in graph.nodes]
    float_input = graph.input_dtype == "float32"  # token ids stay int32 for the embedding
    tied = {
        node.index: table for node in graph.nodes if (table := graph.tied_table(node)) is not None
    }

    def forward(
        weights: Params, x: jax.Array, train: TrainInputs | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        env = Env(weights, compute, plan.seed, train, tied_tables=tied)
        values = {MODEL_INPUT: x.astype(compute.dtype) if float_input else x}
        for node, apply in steps:
            values[node.index] = apply(env, [values[source] for source in node.inputs])
        return values[graph.output].astype(compute.full), env.updates

    return forward


# --------------------------------------------------------------------------- losses


@attrs.frozen
class Loss:
    """One loss: each row's loss (in the outputs' dtype: the weights';
    ``row_loss(outputs, targets, label_smoothing)``), its targets' dtype, and how many target
    positions a row's targets hold."""

    row_loss: Callable[[jax.Array, jax.Array, float], jax.Array]
    target_dtype: np.dtype[Any]
    targets_per_row: Callable[[tuple[int, ...]], int]


def _rows(values: jax.Array) -> jax.Array:
    """Sum each row's values over every axis but the batch axis."""
    return values.reshape(values.shape[0], -1).sum(axis=1)


def _cross_entropy(
    logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0
) -> jax.Array:
    """Logits [batch, ..., classes], targets [batch, ...]: the SUM over a row's positions;
    label smoothing e: (1 - e) x the label's negative log-probability plus e x the classes'
    mean one (torch's formula). Float targets [batch, 3] are a mixed row's (label, partner's
    label, lam) (mixup, cutmix): lam x the loss of the label + (1 - lam) x the partner's."""
    if jnp.issubdtype(targets.dtype, jnp.floating):
        own = _cross_entropy(logits, targets[:, 0].astype(jnp.int32), label_smoothing)
        partner = _cross_entropy(logits, targets[:, 1].astype(jnp.int32), label_smoothing)
        lam = targets[:, 2].astype(own.dtype)
        return lam * own + (1 - lam) * partner
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    if label_smoothing:
        picked = (1 - label_smoothing) * picked + label_smoothing * log_probs.mean(axis=-1)
    return -_rows(picked)


def _mse(outputs: jax.Array, targets: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """The mean over a row's output elements."""
    return jnp.square(outputs - targets).reshape(outputs.shape[0], -1).mean(axis=1)


def _binary_cross_entropy(
    logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0
) -> jax.Array:
    """Each output's sigmoid cross-entropy with its float target (tf's stable form
    max(x, 0) - x t + log(1 + exp(-|x|))), the mean over a row's outputs."""
    targets = targets.reshape(logits.shape)
    each = jnp.maximum(logits, 0) - logits * targets + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    return each.reshape(logits.shape[0], -1).mean(axis=1)


#: the losses this backend speaks: the keys are its vocabulary's losses
LOSSES: dict[str, Loss] = {
    # jax runs 32-bit by default: class ids as int32 (vocabularies far below 2**31)
    "cross_entropy": Loss(_cross_entropy, np.dtype(np.int32), lambda shape: math.prod(shape[1:])),
    # a regression or multi-label row counts once, whatever its number of outputs
    "mse": Loss(_mse, np.dtype(np.float32), lambda shape: 1),
    "binary_cross_entropy": Loss(_binary_cross_entropy, np.dtype(np.float32), lambda shape: 1),
}


def _correct(logits: jax.Array, targets: jax.Array, plan: Plan) -> jax.Array:
    """How many of a row's positions have the target as their argmax."""
    return _rows((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))


def _top_k_correct(logits: jax.Array, targets: jax.Array, plan: Plan) -> jax.Array:
    """How many of a row's positions have fewer than ``top_k`` logits above the target's
    (a tie counts for the target)."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    return _rows(((logits > target).sum(axis=-1) < plan.top_k).astype(jnp.float32))


#: the metrics this backend counts in its eval step -> (the sum's name, each row's hits): the
#: keys are its vocabulary's metrics
METRIC_COUNTS: dict[str, tuple[str, Callable[[jax.Array, jax.Array, Plan], jax.Array]]] = {
    "accuracy": ("correct", _correct),
    "top_k_accuracy": ("top_k_correct", _top_k_correct),
}


# --------------------------------------------------------------------------- compiled steps


def make_train_step(
    plan: Plan, forward: Forward, trainable: Sequence[str], shards: Shards | None = None
) -> Callable[..., Any]:
    """train_step(params, buffers, optimizer_state, xs, ys, ws, rows, scale, scalars, step)
    -> (params, buffers, optimizer_state, micro_sums), to be jitted.

    ``shards`` (``train.shard = "full"``): ``params`` come in split over the devices; the
    step gathers them whole for the forward and backward passes (an exact copy: the same
    arithmetic as unsharded), splits each summed gradient as its weight is split, and
    updates each device's part of the weights and of the optimizer's state, elementwise.

    ``params`` are the trainable weights (what the gradient, clipping and the optimizer
    see), ``buffers`` the others (batch norm's moving statistics, updated by each
    micro-batch's forward pass in order). ``xs``/``ys``/``ws``/``rows`` stack the step's
    micro-batches on axis 0; their batch axis is sharded over the devices, so XLA sums each
    gradient across devices (each micro-batch loss is sum(weight * row loss)
    * ``scale``, scale = 1 / global real target positions).
    """
    loss, spec, clip = LOSSES[plan.loss.name], plan.optimizer, plan.train.clip_grad_norm
    smoothing = plan.loss.label_smoothing
    decayed = decayed_weights(plan.model.graph().weight_specs(), spec.decay)

    def micro_loss(
        params: Params,
        buffers: Params,
        x: jax.Array,
        y: jax.Array,
        train: TrainInputs,
        scale: jax.Array,
    ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
        outputs, updates = forward({**params, **buffers}, x, train)
        micro_sum = (loss.row_loss(outputs, y, smoothing) * train.weight).sum()
        return micro_sum * scale, (micro_sum, updates)

    gradient = jax.grad(micro_loss, has_aux=True)

    def train_step(
        params: Tree,
        buffers: Tree,
        optimizer_state: OptimizerState,
        xs: jax.Array,
        ys: jax.Array,
        ws: jax.Array,
        rows: jax.Array,
        scale: jax.Array,
        scalars: Mapping[str, jax.Array],
        step: jax.Array,
    ) -> tuple[Tree, Tree, OptimizerState, jax.Array]:
        def accumulate(carry: Carry, micro: tuple[jax.Array, ...]) -> tuple[Carry, jax.Array]:
            total, moving = carry
            x, y, weight, row = micro
            grads, (micro_sum, updates) = gradient(
                params, moving, x, y, TrainInputs(step, row, weight), scale
            )
            summed = {name: total[name] + grads[name] for name in total}
            return (summed, {**moving, **updates}), micro_sum

        kept = params
        if shards is not None:
            params = lax.with_sharding_constraint(params, shards.whole)
        zeros = {name: jnp.zeros_like(value) for name, value in params.items()}
        (grads, buffers), micro_sums = lax.scan(accumulate, (zeros, buffers), (xs, ys, ws, rows))
        if shards is not None:
            params, grads = kept, lax.with_sharding_constraint(grads, shards.parts)
        if clip is not None:
            grads = clip_by_global_norm(grads, trainable, clip)
        new_params, new_state = apply_update(spec, params, grads, optimizer_state, scalars, decayed)
        return new_params, buffers, new_state, micro_sums

    return train_step


@attrs.frozen
class Shards:
    """Where a fully sharded run's weights live: ``parts``, each weight's placement (split
    over the devices along an axis that divides); ``whole``, the replicated placement the
    passes read them in."""

    parts: Mapping[str, Any]
    whole: Any


def gathered(function: Callable[..., Any], shards: Shards | None) -> Callable[..., Any]:
    """``function(weights, ...)`` reading its weights whole: under ``train.shard = "full"``
    they are gathered first, so evaluation and prediction compute exactly as unsharded."""
    if shards is None:
        return function

    def whole(weights: Params, *rest: Any) -> Any:
        return function(lax.with_sharding_constraint(weights, shards.whole), *rest)

    return whole


def make_eval_step(
    plan: Plan, forward: Forward
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """eval_step(weights, x, y) -> (per-row loss, {sum name: per-row hits} of each counted
    metric of the plan), to be jitted. The host sums them in float64, in row order, so the
    totals do not depend on the device count."""
    loss = LOSSES[plan.loss.name]
    counted = [METRIC_COUNTS[metric] for metric in plan.metrics if metric in METRIC_COUNTS]

    def eval_step(
        weights: Params, x: jax.Array, y: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        outputs, _ = forward(weights, x, None)
        losses = loss.row_loss(outputs, y, plan.loss.label_smoothing)
        return losses, {name: hits(outputs, y, plan) for name, hits in counted}

    return eval_step
