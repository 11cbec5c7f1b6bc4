"""The compiled functions a TfStrategy runs on its replicas: one optimizer step, the
evaluation sums and the predictions, each a tf.function over the distribution; and the
tensor helpers they share (how a replica finds its rows, how a step's inputs are packed).

This module imports tensorflow only inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from crosstrain.backends.tf.optimizer import (
    LOSS_SCALE,
    REAL_TARGETS,
    SCALAR_COUNT,
    UpdateRule,
    clip_like_torch,
    update_rule,
)
from crosstrain.backends.tf.zero import ShardedSlots, update_run
from crosstrain.core.data.batches import StepBatch
from crosstrain.core.model.optimizers import decayed_weights
from crosstrain.core.spec.plan import Plan

#: (the step's input tensors, this replica's part) -> this replica's x and y rows: the
#: inputs are the rows themselves (x, y) or, from placed data, their indices (indices,)
Fetch = Callable[[tuple[Any, ...], Any], tuple[Any, Any]]


def train_function(
    distribution: Any,
    local: int,
    model: Any,
    variables: list[Any],
    slots: list[tuple[Any, ...]],
    plan: Plan,
    fetch: Fetch,
    sharded: ShardedSlots | None = None,
) -> Any:
    """One optimizer step as a tf.function: each replica runs forward and backward on
    its rows of every micro-batch (``fetch``: from the host's rows or the placed data;
    with their row mask, global row positions and the step, for batch norm and
    dropout), each micro-batch's weighted loss sum divided by the step's real target
    positions; gradients are summed across replicas (rule 4), then every copy of every
    variable gets the same update (``sharded``, under ``train.shard = "optimizer"``: each
    replica updates its run of the elements, :mod:`crosstrain.backends.tf.zero`, and
    ``slots`` is empty). ``local``: the replicas in this process. The function
    takes the step's inputs and :func:`pack_step`'s two arrays; it returns the step's mean
    loss (the loss sum over all replicas / the normaliser) and whether its update was
    applied, as tensors."""
    import tensorflow as tf

    from crosstrain.backends.tf.model import forward, per_row_loss

    train, loss_spec, accumulation = plan.train, plan.loss, plan.train.grad_accum_steps
    scaled = train.precision == "fp16"
    guarded = guarded_steps(plan)
    rules = [update_rule(plan.optimizer, decays) for decays in decayed_variables(model, plan, variables)]
    keras_variables = list(model.trainable_variables)

    def replica_gradients(micro: list[tuple[Any, ...]], step: Any, scalars: Any) -> tuple[list[Any], Any]:
        """This replica's gradients and loss sum over its (x, y, weight, rows) of each
        micro-batch: no cross-replica op unless the model has batch norm (which
        train.compile refuses at world > 1), so XLA may compile it."""
        grads: list[Any] = []
        loss_sum = tf.zeros((), tf.float64)
        for index, (x, y, weight, row) in enumerate(micro):
            with tf.GradientTape() as tape:
                outputs = forward(model, x, training=True, weight=weight, rows=row, step=step)
                micro_sum = tf.reduce_sum(per_row_loss(loss_spec, outputs, y) * weight)
                loss = micro_sum / scalars[REAL_TARGETS]
                if scaled:
                    loss = loss * scalars[LOSS_SCALE]
            micro_grads = tape.gradient(loss, keras_variables)
            micro_grads = [_dense_gradient(g, v) for g, v in zip(micro_grads, variables, strict=True)]
            grads = micro_grads if index == 0 else [a + b for a, b in zip(grads, micro_grads, strict=True)]
            loss_sum += tf.cast(micro_sum, tf.float64)
        return grads, loss_sum

    if train.compile:
        # XLA compiles each replica's forward and backward (as Keras 3 does); the
        # all-reduce and the update stay outside, where the strategy places them
        replica_gradients = tf.function(replica_gradients, jit_compile=True)

    def replica_step(
        inputs: tuple[Any, ...], weights: Any, rows: Any, step: Any, scalars: Any
    ) -> tuple[Any, Any, Any]:
        context = tf.distribute.get_replica_context()
        part = context.replica_id_in_sync_group % local
        micro = []
        for index in range(accumulation):
            # the rows are gathered here, outside XLA: placed data's variables stay out of it
            x, y = fetch(tuple(tensor[index] for tensor in inputs), part)
            micro.append(
                (x, y, replica_rows(weights[index], part, local), replica_rows(rows[index], part, local))
            )
        grads, loss_sum = replica_gradients(micro, step, scalars)
        grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        finite = tf.constant(True)
        if scaled:
            grads = [g * (1.0 / scalars[LOSS_SCALE]) for g in grads]
        if guarded:
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        if train.clip_grad_norm is not None:
            grads = clip_like_torch(grads, train.clip_grad_norm)
        return grads, loss_sum, finite

    def apply(variable: Any, grad: Any, finite: Any, scalars: Any, rule: UpdateRule, *state: Any) -> Any:
        value, new_state = rule(variable, grad, state, scalars)
        if guarded:  # an inf/nan step is skipped, as GradScaler skips optimizer.step()
            value = tf.where(finite, value, variable)
            new_state = tuple(tf.where(finite, new, old) for new, old in zip(new_state, state, strict=True))
        for slot, new in zip(state, new_state, strict=True):
            slot.assign(new)
        return variable.assign(value)

    def sharded_step(
        inputs: tuple[Any, ...], weights: Any, rows: Any, step: Any, scalars: Any
    ) -> tuple[Any, Any, Any]:
        grads, loss_sum, finite = replica_step(inputs, weights, rows, step, scalars)
        assert sharded is not None
        return update_run(sharded, variables, grads, rules, scalars, finite, guarded), loss_sum, finite

    def train_function(inputs: tuple[Any, ...], integers: Any, floats: Any) -> tuple[Any, Any]:
        step, normaliser, rows, scalars, weights = unpack_step(integers, floats, accumulation)
        arguments = (inputs, weights, rows, step, scalars)
        if sharded is None:
            grads, loss_sum, finite = distribution.run(replica_step, args=arguments)
            for variable, grad, state, rule in zip(variables, grads, slots, rules, strict=True):
                distribution.extended.update(
                    variable, apply, args=(grad, finite, scalars, rule, *state), group=False
                )
        else:
            values, loss_sum, finite = distribution.run(sharded_step, args=arguments)
            for variable, value in zip(variables, values, strict=True):
                distribution.extended.update(variable, _assign, args=(value,), group=False)
        total = distribution.reduce(tf.distribute.ReduceOp.SUM, loss_sum, axis=None)
        # a float64 division: the same bits as float(total) / normaliser on the host
        return total / normaliser, distribution.experimental_local_results(finite)[0]

    return tf.function(train_function, autograph=False)


def _assign(variable: Any, value: Any) -> Any:
    return variable.assign(value)


def eval_function(distribution: Any, local: int, model: Any, plan: Plan, fetch: Fetch) -> Any:
    """Float64 sums over the real rows of the whole global batch, across every replica, in
    :func:`eval_names` order; ``fetch`` reads each replica's rows (from the host's rows or
    the placed data)."""
    import tensorflow as tf

    from crosstrain.backends.tf.model import METRIC_COUNTS, forward, per_row_loss, targets_per_row

    counted = [METRIC_COUNTS[metric][1] for metric in plan.metrics if metric in METRIC_COUNTS]

    def replica_eval(inputs: tuple[Any, ...], weight: Any, rows: Any) -> Any:
        part = tf.distribute.get_replica_context().replica_id_in_sync_group % local
        x, y = fetch(inputs, part)
        weight, rows = (replica_rows(t, part, local) for t in (weight, rows))
        outputs = forward(model, x, training=False, weight=weight, rows=rows)
        weight = tf.cast(weight, tf.float64)
        sums = [tf.reduce_sum(tf.cast(per_row_loss(plan.loss, outputs, y), tf.float64) * weight)]
        for hits in counted:
            sums.append(tf.reduce_sum(tf.cast(hits(outputs, y, plan), tf.float64) * weight))
        sums.append(tf.reduce_sum(weight) * targets_per_row(y))
        return tf.stack(sums)

    def eval_function(inputs: tuple[Any, ...], weight: Any, rows: Any) -> Any:
        per_replica = distribution.run(replica_eval, args=(inputs, weight, rows))
        return distribution.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return tf.function(eval_function, autograph=False)


def eval_names(plan: Plan) -> list[str]:
    """The names of :func:`eval_function`'s sums, in order."""
    from crosstrain.backends.tf.model import METRIC_COUNTS

    counted = [METRIC_COUNTS[metric][0] for metric in plan.metrics if metric in METRIC_COUNTS]
    return ["loss_sum", *counted, "count"]


def decayed_variables(model: Any, plan: Plan, variables: list[Any]) -> list[bool]:
    """Whether weight decay applies to each of ``variables`` (the trainable ones, in order):
    core chooses by neutral name (``optimizer.decay``); a native model's all decay."""
    if plan.optimizer.decay == "all":
        return [True] * len(variables)
    from crosstrain.backends.tf.model import neutral_variables

    decayed = decayed_weights(plan.model.graph().weight_specs(), plan.optimizer.decay)
    chosen = {id(variable.value): name in decayed for name, variable in neutral_variables(model).items()}
    return [chosen[id(variable)] for variable in variables]


def predict_function(distribution: Any, model: Any) -> Any:
    """Inference outputs as float32, on this process's (one) replica."""
    import tensorflow as tf

    from crosstrain.backends.tf.model import forward

    def predict_function(x: Any) -> Any:
        outputs = distribution.run(
            lambda rows: tf.cast(forward(model, rows, training=False), tf.float32), args=(x,)
        )
        return distribution.experimental_local_results(outputs)[0]

    return tf.function(predict_function, reduce_retracing=True)


def guarded_steps(plan: Plan) -> bool:
    """Whether a step's update can be skipped: fp16 skips an overflowing step (as
    GradScaler does); on_nonfinite = "skip" any step whose summed gradients are not finite."""
    return plan.train.precision == "fp16" or plan.train.on_nonfinite == "skip"


def host_rows(local: int, convert_x: Callable[[Any], Any] | None = None) -> Fetch:
    """This replica's rows of the (x, y) gathered on the host; ``convert_x`` turns x rows
    as their data set stores them into the model's (on this replica's device)."""

    def fetch(inputs: tuple[Any, ...], part: Any) -> tuple[Any, Any]:
        x, y = inputs
        x = replica_rows(x, part, local)
        return (x if convert_x is None else convert_x(x)), replica_rows(y, part, local)

    return fetch


def placed_rows(gather_x: Callable[[Any], Any], gather_y: Callable[[Any], Any], local: int) -> Fetch:
    """This replica's rows gathered from the placed data (its device's copy) by index."""

    def fetch(inputs: tuple[Any, ...], part: Any) -> tuple[Any, Any]:
        (indices,) = inputs
        mine = replica_rows(indices, part, local)
        return gather_x(mine), gather_y(mine)

    return fetch


def pack_step(step: StepBatch, scalars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A step's small inputs in two arrays, one per dtype: each argument of a tf.function
    costs its call a conversion and a match against the traced signature, a cost a small
    model's step feels (docs/performance.md#measurements-behind-the-code). Integers: the
    step, the loss normaliser (a count, exact in int64) and every micro-batch's row
    positions; floats: the step's scalars (:func:`step_scalars`) and every micro-batch's
    row weights, in the scalars' dtype (the weights': float32, or float64 under fp64)."""
    micro = step.micro_batches
    integers = np.concatenate([[step.step, step.global_real_targets], *(batch.rows for batch in micro)])
    floats = np.concatenate([scalars, *(batch.weight for batch in micro)])
    return integers.astype(np.int64, copy=False), floats.astype(scalars.dtype, copy=False)


def unpack_step(integers: Any, floats: Any, accumulation: int) -> tuple[Any, Any, Any, Any, Any]:
    """:func:`pack_step`'s arrays, inside the step: the step, the normaliser as float64, the
    row positions and weights as [micro-batch, row] (static shapes), and the scalars."""
    import tensorflow as tf

    step, normaliser = integers[0], tf.cast(integers[1], tf.float64)
    rows = tf.reshape(integers[2:], [accumulation, -1])
    weights = tf.reshape(floats[SCALAR_COUNT:], [accumulation, -1])
    return step, normaliser, rows, floats[:SCALAR_COUNT], weights


def _dense_gradient(grad: Any, variable: Any) -> Any:
    """A dense gradient for every variable: zeros where the loss does not reach it, and
    an embedding's IndexedSlices made dense, which the all-reduce and the update need."""
    import tensorflow as tf

    return tf.zeros_like(variable) if grad is None else tf.convert_to_tensor(grad)


def replica_rows(tensor: Any, part: Any, parts: int) -> Any:
    """Contiguous slice ``part`` of ``parts`` along the first axis, with a static shape."""
    import tensorflow as tf

    if parts == 1:
        return tensor
    rows = tensor.shape[0] // parts
    return tf.gather(tf.reshape(tensor, [parts, rows, *tensor.shape[1:]]), part)
