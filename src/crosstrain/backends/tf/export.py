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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np

from crosstrain.backends.tf.layers import LAYERS
from crosstrain.core.errors import InputError
from crosstrain.core.graph import MODEL_INPUT
from crosstrain.core.plan import Plan

MODEL_FILE = "model.keras"
#: largest difference between the saved model's outputs and crosstrain's
TOLERANCE = 1e-5


def stock_model(plan: Plan, weights: dict[str, np.ndarray]) -> keras.Model:
    """The plan's graph as a functional model of stock Keras layers, holding ``weights``."""
    graph = plan.model.graph(plan.source)
    inputs = keras.Input(shape=plan.model.input_shape, dtype=plan.model.input_dtype, name="x")
    values: dict[int, Any] = {MODEL_INPUT: inputs}
    layers = []
    for node in graph.nodes:
        stock = LAYERS[type(node.layer)].stock()
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
    return model


def export_keras(
    model: keras.Model,
    plan: Plan,
    weights: dict[str, np.ndarray],
    out: Path,
    expected: np.ndarray,
    sample: np.ndarray,
) -> list[Path]:
    """Write ``model.keras`` under ``out`` (stock layers, or the native model as it is);
    check that it loads and gives ``expected`` for ``sample``."""
    exported = model if plan.model.native is not None else stock_model(plan, weights)
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
