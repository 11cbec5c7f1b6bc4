"""``crosstrain export --format keras``: a ``.keras`` file that ``keras.saving.load_model``
reads without crosstrain.

crosstrain's :class:`~crosstrain.backends.tf.model.GraphModel` and its own layers (batch
norm over real rows, hashed dropout) would need crosstrain to load. In inference they
compute what Keras's stock layers compute, so the export rebuilds the graph as a
functional model of stock layers (``EXPORT_LAYERS``), copies the weights, saves it, loads
it back and checks its outputs against crosstrain's. A layer with no stock equivalent
(attention, the position table) is refused in one line naming it. A user's native Keras
model is saved as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np

from crosstrain.core.errors import InputError
from crosstrain.core.graph import MODEL_INPUT, Node
from crosstrain.core.layers import (
    GELU,
    Add,
    AvgPool2D,
    BatchNorm,
    Concat,
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    Layer,
    LayerNorm,
    MaxPool2D,
    ReLU,
    Tanh,
)
from crosstrain.core.plan import Plan

MODEL_FILE = "model.keras"
#: largest difference between the saved model's outputs and crosstrain's
TOLERANCE = 1e-5

Builder = Callable[[Any, Node], keras.layers.Layer]


def _named(node: Node) -> dict[str, Any]:
    return {"name": node.path, "dtype": "float32"}


def _stock(factory: Callable[..., keras.layers.Layer], *args: Any, **kwargs: Any) -> Builder:
    return lambda layer, node: factory(*args, **kwargs, **_named(node))


#: core layer type -> the stock Keras layer that computes it in inference
EXPORT_LAYERS: dict[type[Layer], Builder] = {
    Dense: lambda layer, node: keras.layers.Dense(layer.units, use_bias=layer.use_bias, **_named(node)),
    Conv2D: lambda layer, node: keras.layers.Conv2D(
        layer.filters,
        layer.kernel_size,
        strides=layer.strides,
        padding=layer.padding,
        use_bias=layer.use_bias,
        **_named(node),
    ),
    MaxPool2D: lambda layer, node: keras.layers.MaxPooling2D(
        layer.pool_size, strides=layer.effective_strides, padding="valid", **_named(node)
    ),
    AvgPool2D: lambda layer, node: keras.layers.AveragePooling2D(
        layer.pool_size, strides=layer.effective_strides, padding="valid", **_named(node)
    ),
    GlobalAvgPool2D: _stock(keras.layers.GlobalAveragePooling2D),
    Flatten: _stock(keras.layers.Flatten),
    ReLU: _stock(keras.layers.ReLU),
    GELU: _stock(keras.layers.Activation, "gelu"),  # Keras's gelu activation is erf's by default
    Tanh: _stock(keras.layers.Activation, "tanh"),
    Dropout: lambda layer, node: keras.layers.Dropout(layer.rate, **_named(node)),  # off in inference
    LayerNorm: lambda layer, node: keras.layers.LayerNormalization(
        axis=-1, epsilon=layer.eps, **_named(node)
    ),
    BatchNorm: lambda layer, node: keras.layers.BatchNormalization(
        axis=-1, momentum=layer.momentum, epsilon=layer.epsilon, **_named(node)
    ),
    Embedding: lambda layer, node: keras.layers.Embedding(layer.vocab_size, layer.units, **_named(node)),
    Add: _stock(keras.layers.Add),
    Concat: _stock(keras.layers.Concatenate, axis=-1),
}

_KERNEL = {"kernel": "kernel", "bias": "bias"}
#: core layer type -> neutral param -> the stock layer's attribute holding it
EXPORT_WEIGHTS: dict[type[Layer], dict[str, str]] = {
    Dense: _KERNEL,
    Conv2D: _KERNEL,
    LayerNorm: {"scale": "gamma", "offset": "beta"},
    BatchNorm: {"scale": "gamma", "offset": "beta", "moving_mean": "moving_mean"}
    | {"moving_variance": "moving_variance"},
    Embedding: {"table": "embeddings"},
}


def stock_model(plan: Plan, weights: dict[str, np.ndarray]) -> keras.Model:
    """The plan's graph as a functional model of stock Keras layers, holding ``weights``."""
    graph = plan.model.graph(plan.source)
    inputs = keras.Input(shape=plan.model.input_shape, dtype=plan.model.input_dtype, name="x")
    values: dict[int, Any] = {MODEL_INPUT: inputs}
    layers = []
    for node in graph.nodes:
        builder = EXPORT_LAYERS.get(type(node.layer))
        if builder is None:
            raise InputError(
                f"--format keras: {node.field} ({node.layer.type!r}) has no stock Keras layer; "
                "--format torch exports every layer"
            )
        layer = builder(node.layer, node)
        sources = [values[source] for source in node.inputs]
        values[node.index] = layer(sources[0] if node.layer.arity == 1 else sources)
        layers.append((node, layer))
    model = keras.Model(inputs, values[graph.output], name=plan.name)
    for node, layer in layers:
        for param, attribute in EXPORT_WEIGHTS.get(type(node.layer), {}).items():
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
