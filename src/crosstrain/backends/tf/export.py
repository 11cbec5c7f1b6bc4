"""``crosstrain export --format keras``: a ``.keras`` file that ``keras.saving.load_model``
reads without crosstrain.

crosstrain's :class:`~crosstrain.backends.tf.model.GraphModel` and its own layers (batch
norm over real rows, hashed dropout) would need crosstrain to load. In inference they
compute what Keras's stock layers compute, so the export rebuilds the graph as a
functional model of stock layers (each layer type's row says which: ``NodeSpec.export``
in layers.py), copies the weights, saves it, loads
it back and checks its outputs against crosstrain's. A layer with no stock equivalent
(attention, the position table) is refused in one line naming it. A user's native Keras
model is saved as it is.

Either way the saved model takes the raw rows ``crosstrain predict`` takes: it begins
with the plan's input scaling as stock layers, ``Rescaling(scale)`` for ``data.scale``
and ``Normalization(mean, variance = std**2)`` for ``data.mean``/``std``, which compute
training's float32 operations bit for bit (x * scale, then (x - mean) / sqrt(std**2),
and in binary floating point sqrt(fl(s * s)) is s).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import keras
import numpy as np

from crosstrain.backends.tf.layers import LAYERS
from crosstrain.core.data.scaling import InputScaling
from crosstrain.core.errors import InputError
from crosstrain.core.model.graph import MODEL_INPUT
from crosstrain.core.spec.plan import Plan

MODEL_FILE = "model.keras"
#: largest difference between the saved model's outputs and crosstrain's
TOLERANCE = 1e-5


def unused_name(wanted: str, taken: Collection[str]) -> str:
    """``wanted``, or ``wanted_2``, ``wanted_3``...: a Keras model's layer names are unique,
    and a plan may name its own layers "x" or "scale"."""
    name, number = wanted, 1
    while name in taken:
        number += 1
        name = f"{wanted}_{number}"
    return name


def scaling_layers(
    scaling: InputScaling, channels: int, taken: Collection[str] = ()
) -> list[keras.layers.Layer]:
    """Stock layers that compute ``scaling`` (none for the identity), named apart from ``taken``."""
    layers: list[keras.layers.Layer] = []
    if scaling.scale != 1.0:
        layers.append(keras.layers.Rescaling(scale=scaling.scale, name=unused_name("scale", taken)))
    if any(operation != "mul" for operation, _ in scaling.steps()):
        mean = np.broadcast_to(np.asarray(scaling.mean or (0.0,), np.float32), (channels,))
        std = np.broadcast_to(np.asarray(scaling.std or (1.0,), np.float32), (channels,))
        variance = std * std  # rounded to float32: its float32 square root is std again
        layers.append(
            keras.layers.Normalization(
                mean=mean.tolist(), variance=variance.tolist(), name=unused_name("normalise", taken)
            )
        )
    return layers


def _scaled_input(plan: Plan, taken: Collection[str]) -> tuple[Any, Any]:
    """The model's raw input and its value after the plan's input scaling (their layers
    named apart from the model's own, ``taken``)."""
    name = unused_name("x", taken)
    inputs = keras.Input(shape=plan.model.input_shape, dtype=plan.model.input_dtype, name=name)
    value = inputs
    for layer in scaling_layers(plan.data.scaling, plan.model.input_shape[-1], {*taken, name}):
        value = layer(value)
    return inputs, value


def stock_model(plan: Plan, weights: dict[str, np.ndarray]) -> keras.Model:
    """The plan's graph as a functional model of stock Keras layers, holding ``weights``,
    taking raw rows."""
    graph = plan.model.graph(plan.source)
    inputs, scaled = _scaled_input(plan, {node.path for node in graph.nodes})
    values: dict[int, Any] = {MODEL_INPUT: scaled}
    layers = []
    for node in graph.nodes:
        stock = LAYERS[node.layer.type].stock()
        if stock is None:
            raise InputError(
                f"--format keras: {node.field} ({node.layer.type!r}) has no stock Keras layer; "
                "--format torch exports every layer"
            )
        layer = stock.build(node.layer, node)
        sources = [values[source] for source in node.inputs]
        values[node.index] = layer(sources[0] if node.layer.arity == 1 else sources)
        layers.append((node, layer, stock.weights))
    model = keras.Model(inputs, values[graph.output], name=plan.name)
    for node, layer, attributes in layers:
        for param, attribute in attributes.items():
            if param in node.weight_specs():
                getattr(layer, attribute).assign(np.asarray(weights[f"{node.path}.{param}"], np.float32))
        table = graph.tied_table(node)
        if table is not None:  # a tied dense exports as Keras's Dense holding a copy of the table
            layer.kernel.assign(np.asarray(weights[table], np.float32).T)
    return model


def native_model(model: keras.Model, plan: Plan) -> keras.Model:
    """A user's native model, after the input scaling when the plan has one."""
    if plan.data.scaling.is_identity:
        return model
    inputs, scaled = _scaled_input(plan, {model.name})
    return keras.Model(inputs, model(scaled), name=plan.name)


def export_keras(
    model: keras.Model,
    plan: Plan,
    weights: dict[str, np.ndarray],
    out: Path,
    expected: np.ndarray,
    sample: np.ndarray,
) -> list[Path]:
    """Write ``model.keras`` under ``out`` (stock layers, or the native model as it is,
    either after the input scaling); check that it loads and gives ``expected`` for
    ``sample`` (raw rows)."""
    exported = native_model(model, plan) if plan.model.native is not None else stock_model(plan, weights)
    out.mkdir(parents=True, exist_ok=True)
    path = out / MODEL_FILE
    exported.save(str(path))
    loaded = keras.saving.load_model(str(path))
    got = np.asarray(loaded.predict(sample, verbose=0, batch_size=len(sample)), np.float32)
    difference = float(np.max(np.abs(got - expected))) if expected.size else 0.0
    if not difference <= TOLERANCE:
        path.unlink()
        raise InputError(
            f"--format keras: the saved model differs from crosstrain's by {difference:.3g} "
            f"(more than {TOLERANCE:g}); nothing was written"
        )
    return [path]
