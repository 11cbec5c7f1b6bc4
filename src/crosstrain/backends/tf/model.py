"""The plan's model as a Keras 3 model, weights between neutral and Keras names, and the
loss and precision tables.

The neutral model is a :class:`GraphModel`: one Keras layer per graph node (the table in
layers.py), named by the node's neutral path and run in graph order. At the edges
everything is neutral: NHWC inputs, kernels [in, out] and [kh, kw, in, out], weights
``{node.path}.{param}`` (batch norm's moving statistics included).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from crosstrain.backends.native import native_factory
from crosstrain.backends.tf.layers import LAYERS
from crosstrain.backends.tf.nodes import ContextLayer, NodeOptions
from crosstrain.core.model.graph import MODEL_INPUT, Graph
from crosstrain.core.spec.plan import LossSpec, Plan

#: core precision -> Keras dtype policy: float32 variables, low-precision compute; fp64:
#: float64 variables and compute (core's ``WEIGHT_DTYPES``)
DTYPE_POLICIES: dict[str, str] = {
    "fp32": "float32",
    "bf16": "mixed_bfloat16",
    "fp16": "mixed_float16",
    "fp64": "float64",
}


class GraphModel(keras.Model):  # type: ignore[misc]
    """Runs the graph's nodes in order; each reads the outputs of its input nodes.

    ``call(inputs, training, weight, rows, step)``: ``weight`` is the float row mask
    (1 real, 0 padding), ``rows`` the int64 positions of the rows in the step's global
    batch and ``step`` the int64 optimizer step; batch norm and dropout read them in
    training (without them every row is real, rows count from 0, the step is 0)."""

    def __init__(self, graph: Graph, seed: int, policy: str, name: str) -> None:
        super().__init__(name=name, dtype=policy)
        self.neutral_graph = graph
        options = NodeOptions(policy=policy, seed=seed)
        self.node_layers = [LAYERS[node.layer.type].build(node.layer, node, options) for node in graph.nodes]
        for node in graph.nodes:  # a tied dense reads its embedding's table
            if node.tied_to is not None:
                self.node_layers[node.index].tie(self.node_layers[node.tied_to])

    def build(self, input_shape: Any = None) -> None:
        """Build every node's layer from the graph's shapes (rows of any count)."""
        for node, layer in zip(self.neutral_graph.nodes, self.node_layers, strict=True):
            shapes = [(None, *shape) for shape in node.input_shapes]
            layer.build(shapes[0] if len(shapes) == 1 else shapes)

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        values: dict[int, Any] = {MODEL_INPUT: inputs}
        for node, layer in zip(self.neutral_graph.nodes, self.node_layers, strict=True):
            sources = [values[source] for source in node.inputs]
            x = sources[0] if len(sources) == 1 else sources  # merges, attention with its mask
            if isinstance(layer, ContextLayer):
                values[node.index] = layer(x, training=training, weight=weight, rows=rows, step=step)
            else:
                values[node.index] = layer(x)  # Keras passes `training` on through its call context
        return values[self.neutral_graph.output]

    def neutral_variables(self) -> dict[str, Any]:
        """Neutral weight name -> the Keras variable holding it, in the graph's order."""
        variables: dict[str, Any] = {}
        for node, layer in zip(self.neutral_graph.nodes, self.node_layers, strict=True):
            for param in node.weight_specs():
                variables[f"{node.path}.{param}"] = getattr(layer, LAYERS[node.layer.type].weights[param])
        return variables


@contextlib.contextmanager
def _global_dtype_policy(policy: str) -> Iterator[None]:
    """A native factory builds its own layers: give it the plan's policy, then restore."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build_model(plan: Plan) -> keras.Model:
    """The plan's model, built: a :class:`GraphModel`, or the native factory's model.

    Call it under the distribution's scope so that its variables are mirrored. Its
    weights start at zero or Keras's defaults: load crosstrain's with :func:`load_neutral`."""
    policy = DTYPE_POLICIES[plan.train.precision]
    if plan.model.native is not None:
        with _global_dtype_policy(policy):
            model = native_factory(plan, "tf")(plan)
        if not isinstance(model, keras.Model):
            raise TypeError(f"the native tf factory returned {type(model).__name__}, not keras.Model")
        if not model.built:
            model.build((None, *plan.model.input_shape))
        return model
    graph_model = GraphModel(plan.model.graph(plan.source), plan.seed, policy, plan.name)
    graph_model.build((None, *plan.model.input_shape))
    return graph_model


def forward(
    model: keras.Model, x: Any, *, training: bool, weight: Any = None, rows: Any = None, step: Any = None
) -> Any:
    """The model's outputs; a native model gets its input alone, as it always has. Float
    rows reach the model in its variables' dtype: fp64 widens the float32 rows the feed
    gives (exactly) to float64 here, once."""
    if x.dtype.is_floating and x.dtype != model.variable_dtype:
        x = tf.cast(x, model.variable_dtype)
    if isinstance(model, GraphModel):
        return model(x, training=training, weight=weight, rows=rows, step=step)
    return model(x, training=training)


# --------------------------------------------------------------------------- weights


def _neutral_variables(model: keras.Model) -> dict[str, Any]:
    """Neutral weight name -> Keras variable; a native model's are its variable paths."""
    if isinstance(model, GraphModel):
        return model.neutral_variables()
    return {variable.path: variable for variable in model.weights}


def neutral_variables(model: keras.Model) -> dict[str, Any]:
    """Neutral weight name -> Keras variable (a native model's: its variable paths)."""
    return _neutral_variables(model)


def load_neutral(model: keras.Model, plan: Plan, weights: Mapping[str, np.ndarray]) -> None:
    """Assign neutral weights (moving statistics included) to the model.

    Outside a replica this writes every mirrored copy, on every device."""
    variables = _neutral_variables(model)
    unknown = sorted(set(weights) - set(variables))
    if unknown:
        raise KeyError(f"no variable for weights {unknown} in the tf model")
    for name, value in weights.items():
        variable = variables[name]
        # in the variable's dtype: float32 and float64 weights load into either
        array = np.asarray(value, dtype=variable.dtype)
        if tuple(variable.shape) != array.shape:
            raise ValueError(f"{name}: shape {list(array.shape)} does not fit {list(variable.shape)}")
        variable.assign(array)


def neutral_state(model: keras.Model, plan: Plan) -> dict[str, np.ndarray]:
    """The model's weights under neutral names and channels-last layouts, as numpy in the
    plan's weight dtype (float32; float64 under fp64)."""
    return {
        name: np.asarray(variable.numpy(), dtype=plan.train.weight_dtype)
        for name, variable in _neutral_variables(model).items()
    }


# --------------------------------------------------------------------------- losses


def _rows_of(tensor: Any) -> Any:
    """[batch, ...] -> [batch, everything else]."""
    return tf.reshape(tensor, [tf.shape(tensor)[0], -1])


def _cross_entropy_rows(outputs: Any, targets: Any, loss: LossSpec) -> Any:
    """Logits [batch, ..., classes], targets [batch, ...]: the sum over each row's positions;
    with label smoothing e, (1 - e) x the label's negative log-probability plus e x the mean
    over the classes of theirs (torch's formula). Float targets [batch, 3] are a mixed row's
    (label, partner's label, lam) (mixup, cutmix): lam x the loss of the label + (1 - lam) x
    the loss of the partner's."""
    if targets.dtype.is_floating:
        own = _cross_entropy_rows(outputs, tf.cast(targets[:, 0], tf.int64), loss)
        partner = _cross_entropy_rows(outputs, tf.cast(targets[:, 1], tf.int64), loss)
        lam = tf.cast(targets[:, 2], own.dtype)
        return lam * own + (1.0 - lam) * partner
    if not loss.label_smoothing:
        per_position = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=outputs)
    else:
        log_probabilities = tf.nn.log_softmax(outputs, axis=-1)
        picked = tf.gather(log_probabilities, targets, batch_dims=len(targets.shape))
        smooth = tf.reduce_mean(log_probabilities, axis=-1)
        per_position = -((1.0 - loss.label_smoothing) * picked + loss.label_smoothing * smooth)
    return tf.reduce_sum(_rows_of(per_position), axis=1)


def _mse_rows(outputs: Any, targets: Any, loss: LossSpec) -> Any:
    """The mean squared error over each row's outputs."""
    return tf.reduce_mean(_rows_of(tf.square(outputs - tf.reshape(targets, tf.shape(outputs)))), axis=1)


def _binary_cross_entropy_rows(outputs: Any, targets: Any, loss: LossSpec) -> Any:
    """Each output's sigmoid cross-entropy with its float target, averaged over the row."""
    each = tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.reshape(targets, tf.shape(outputs)), logits=outputs
    )
    return tf.reduce_mean(_rows_of(each), axis=1)


#: core loss name -> loss of each row, in the weights' dtype (float32; float64 under fp64)
LOSSES: dict[str, Callable[[Any, Any, LossSpec], Any]] = {
    "cross_entropy": _cross_entropy_rows,
    "mse": _mse_rows,
    "binary_cross_entropy": _binary_cross_entropy_rows,
}


def full_precision(tensor: Any) -> Any:
    """The tensor in at least float32: bf16 and fp16 widened, float32 and float64 (fp64's)
    as they are. The loss is computed there whatever the precision."""
    return tensor if tensor.dtype == tf.float64 else tf.cast(tensor, tf.float32)


def per_row_loss(loss: LossSpec, outputs: Any, targets: Any) -> Any:
    outputs = full_precision(outputs)
    if targets.dtype.is_floating:  # regression and multi-label targets, read as float32
        targets = tf.cast(targets, outputs.dtype)
    return LOSSES[loss.name](outputs, targets, loss)


def correct_per_row(outputs: Any, targets: Any, plan: Plan) -> Any:
    """How many of each row's target positions the argmax of the logits gets right (float)."""
    hits = tf.equal(tf.argmax(outputs, axis=-1, output_type=targets.dtype), targets)
    return tf.reduce_sum(_rows_of(tf.cast(hits, tf.float32)), axis=1)


def top_k_per_row(outputs: Any, targets: Any, plan: Plan) -> Any:
    """How many of each row's target positions have fewer than ``plan.top_k`` logits above
    the target's (a tie counts for the target, as tf.math.in_top_k's)."""
    logits = full_precision(outputs)
    target = tf.gather(logits, targets, batch_dims=len(targets.shape))[..., None]
    above = tf.reduce_sum(tf.cast(logits > target, tf.int32), axis=-1)
    return tf.reduce_sum(_rows_of(tf.cast(above < plan.top_k, tf.float32)), axis=1)


#: metric a backend counts -> (the eval sum it adds to, each row's hits)
METRIC_COUNTS: dict[str, tuple[str, Callable[[Any, Any, Plan], Any]]] = {
    "accuracy": ("correct", correct_per_row),
    "top_k_accuracy": ("top_k_correct", top_k_per_row),
}


def targets_per_row(targets: Any) -> int:
    """Target positions in one row, as :attr:`crosstrain.core.data.batches.ArrayDataset.targets_per_row`:
    every position of integer labels, one for regression targets (averaged within the row)."""
    return math.prod(targets.shape[1:]) if targets.dtype.is_integer else 1
