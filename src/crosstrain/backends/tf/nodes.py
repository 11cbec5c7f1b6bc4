"""What every Keras layer of a neutral node shares: the options a node is built with
(:class:`NodeOptions`), :class:`ContextLayer` (the row mask, row positions and step a
training forward passes to batch norm and dropout), and the sum across replicas."""

from __future__ import annotations

from typing import Any

import attrs
import keras
import tensorflow as tf


@attrs.frozen
class NodeOptions:
    """What every builder gets besides the layer and its node: the Keras dtype policy's
    name and the plan's seed (dropout hashes it)."""

    policy: str
    seed: int


class ContextLayer(keras.layers.Layer):  # type: ignore[misc]
    """A layer whose training forward needs more than its input: ``weight`` (float row
    mask, 1 real / 0 padding), ``rows`` (int64 positions in the step's global batch) and
    ``step`` (int64 optimizer step). Without them every row is real, rows count from 0
    and the step is 0."""

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        raise NotImplementedError


# --------------------------------------------------------------------------- batch norm


def sum_across_replicas(tensor: Any) -> Any:
    """The sum over every replica of every process, differentiable (the gradient of an
    all-reduced sum is the all-reduced sum of the gradients); the identity at world 1."""
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensor)
