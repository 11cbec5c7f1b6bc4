"""What every jax node shares: the precisions (``PRECISIONS``: how a forward pass computes),
the :class:`TrainInputs` a training forward reads, the :class:`Env` of one forward call, and
the types of a built node (``Apply``) and of a table entry (``Builder``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import (
    Layer,
    Node,
    Plan,
)
from jax import lax

Params = Mapping[str, jax.Array]
LayerT = TypeVar("LayerT", bound=Layer)


# --------------------------------------------------------------------------- precisions


@attrs.frozen
class Compute:
    """How the forward pass computes: the activations' dtype and the matmul precision; and
    ``full``, the weights' dtype (crosstrain's ``WEIGHT_DTYPES``), in which the outputs, the
    loss, the normalisations and attention's softmax are computed whatever the precision.
    Weights are masters in ``full``, cast where they are used."""

    dtype: np.dtype[Any]
    matmul: lax.Precision
    full: np.dtype[Any]


#: the precisions this backend speaks. fp16 is absent on purpose: it needs a loss scaler,
#: which this example leaves out, and its absence from the vocabulary refuses it before launch.
#: fp64 needs jax's 64-bit mode, which building an fp64 plan switches on (:func:`use_x64`).
PRECISIONS: dict[str, Compute] = {
    # HIGHEST: GPUs would otherwise run fp32 matmuls in TF32 and lose parity
    "fp32": Compute(np.dtype(np.float32), lax.Precision.HIGHEST, np.dtype(np.float32)),
    "bf16": Compute(np.dtype(jnp.bfloat16), lax.Precision.DEFAULT, np.dtype(np.float32)),
    "fp64": Compute(np.dtype(np.float64), lax.Precision.HIGHEST, np.dtype(np.float64)),
}


def use_x64(plan: Plan) -> None:
    """Switch on jax's 64-bit mode for this process when ``plan`` trains in float64 (jax
    otherwise makes every float64 array float32). The mode is process-wide: the worker is a
    process of its own, and code written for 32 bits here names its dtypes, so a float32
    plan built later in the same process still computes in float32."""
    wide = PRECISIONS[plan.train.precision].full.itemsize == 8
    if wide and not jax.config.read("jax_enable_x64"):  # type: ignore[no-untyped-call]
        jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- the forward pass


@attrs.frozen
class TrainInputs:
    """What only a training forward needs: dropout's counters and batch norm's row weights."""

    step: jax.Array  # uint32 scalar: StepBatch.step
    rows: jax.Array  # uint32 [batch]: Batch.rows, each row's place in the global batch
    weight: jax.Array  # float32 [batch]: 1 for a real row, 0 for padding


# a pytree, so that a compiled function can take it as one argument
jax.tree_util.register_pytree_node(
    TrainInputs,
    lambda inputs: ((inputs.step, inputs.rows, inputs.weight), None),
    lambda _, children: TrainInputs(*children),
)


@attrs.frozen
class Env:
    """One call of the forward pass. ``train`` is None in evaluation. Layers that update
    non-trainable weights (batch norm's moving statistics) write the new values into
    ``updates``; the training step carries them to the next micro-batch."""

    weights: Params
    compute: Compute
    seed: int
    train: TrainInputs | None
    updates: dict[str, jax.Array] = attrs.field(factory=dict)
    #: a tied dense node's index -> the name of its embedding's table
    tied_tables: Mapping[int, str] = attrs.field(factory=dict)

    def param(self, name: str) -> jax.Array:
        # bf16 runs cast the float32 master weights here; the gradient flows back in float32.
        return self.weights[name].astype(self.compute.dtype)


#: a built layer: (env, input values in ``node.inputs`` order) -> output value
Apply = Callable[[Env, Sequence[jax.Array]], jax.Array]
#: a table entry: the node (layer, shapes, weight prefix, the embedding a dense is tied
#: to) -> its Apply
Builder = Callable[[Node], Apply]
#: forward(weights, x, train) -> (outputs in the weights' dtype, updated non-trainable weights)
Forward = Callable[[Params, jax.Array, TrainInputs | None], tuple[jax.Array, dict[str, jax.Array]]]


def layer_of(node: Node, kind: type[LayerT]) -> LayerT:
    """The node's layer as its concrete type (LAYERS dispatches on it, so this holds)."""
    layer = node.layer
    assert isinstance(layer, kind)
    return layer


def single(inputs: Sequence[jax.Array]) -> jax.Array:
    (x,) = inputs
    return x


def elementwise(function: Callable[[jax.Array], jax.Array]) -> Builder:
    def build(node: Node) -> Apply:
        def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
            return function(single(inputs))

        return apply

    return build
