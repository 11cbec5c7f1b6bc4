"""Neutral layers as a Keras 3 model, and weights between neutral and Keras layouts.

Keras is channels-last like the neutral layouts, so kernels travel as they are:
Dense [in, out], Conv2D [kh, kw, in, out], and Flatten already flattens in NHWC
order. Only names change (LayerNorm's ``scale``/``offset`` are Keras's ``gamma``/``beta``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from crosstrain.backends.common import native_factory
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

#: Keras dtype policy per plan precision: float32 variables, low-precision compute.
DTYPE_POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def exact_gelu(x: Any) -> Any:
    """GELU with erf, as torch's default; Keras's op defaults to the tanh approximation."""
    return keras.activations.gelu(x, approximate=False)


class NeutralDropout(keras.layers.Layer):  # type: ignore[misc]
    """Dropout drawing from TensorFlow's stateful generator.

    Keras's own Dropout keeps its seed in a variable that it assigns on every call,
    which a MirroredVariable refuses inside a replica; a stateful op draws a fresh
    mask per replica without any variable."""

    def __init__(self, rate: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if not training or self.rate == 0.0:
            return inputs
        return tf.nn.dropout(inputs, rate=self.rate)


def _keras_layer(layer: Layer, name: str, dtype: str) -> keras.layers.Layer:
    common: dict[str, Any] = {"name": name, "dtype": dtype}
    if isinstance(layer, Dense):
        return keras.layers.Dense(layer.units, use_bias=layer.use_bias, **common)
    if isinstance(layer, Conv2D):
        return keras.layers.Conv2D(
            layer.filters,
            layer.kernel_size,
            strides=layer.strides,
            padding=layer.padding,
            use_bias=layer.use_bias,
            **common,
        )
    if isinstance(layer, MaxPool2D):
        return keras.layers.MaxPooling2D(
            layer.pool_size, strides=layer.effective_strides, padding="valid", **common
        )
    if isinstance(layer, Flatten):
        return keras.layers.Flatten(**common)  # channels_last: NHWC order, as the neutral Flatten
    if isinstance(layer, LayerNorm):
        return keras.layers.LayerNormalization(axis=-1, epsilon=layer.eps, **common)
    if isinstance(layer, Dropout):
        return NeutralDropout(layer.rate, **common)
    if isinstance(layer, ReLU):
        return keras.layers.ReLU(**common)
    if isinstance(layer, GELU):
        return keras.layers.Activation(exact_gelu, **common)
    if isinstance(layer, Tanh):
        return keras.layers.Activation("tanh", **common)
    raise TypeError(f"the tf backend has no Keras layer for {type(layer).__name__}")


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
    """The plan's model as a built keras.Sequential whose layers carry the neutral names.

    Call it under the distribution's scope so that its variables are mirrored."""
    policy = DTYPE_POLICIES[plan.train.precision]
    if plan.model.native is not None:
        with _global_dtype_policy(policy):
            model = native_factory(plan, "tf")(plan)
        if not isinstance(model, keras.Model):
            raise TypeError(f"the native tf factory returned {type(model).__name__}, not keras.Model")
        if not model.built:
            model.build((None, *plan.model.input_shape))
        return model
    layers = [
        _keras_layer(layer, layer_name(layer, index), policy) for index, layer in enumerate(plan.model.layers)
    ]
    return keras.Sequential([keras.Input(shape=plan.model.input_shape), *layers], name=plan.name)


# --------------------------------------------------------------------------- weight layouts

# neutral param -> Keras attribute of the layer; the array layout is the same on both sides
_KERAS_NAMES: dict[type[Layer], dict[str, str]] = {
    Dense: {"kernel": "kernel", "bias": "bias"},
    Conv2D: {"kernel": "kernel", "bias": "bias"},
    LayerNorm: {"scale": "gamma", "offset": "beta"},
}


def _neutral_variables(model: keras.Model, plan: Plan) -> dict[str, Any]:
    """Neutral weight name -> the Keras variable holding it."""
    if plan.model.native is not None:
        return {variable.path: variable for variable in model.weights}
    table: dict[str, Any] = {}
    for index, layer in enumerate(plan.model.layers):
        name = layer_name(layer, index)
        keras_layer = model.get_layer(name)
        for neutral, attribute in _KERAS_NAMES.get(type(layer), {}).items():
            variable = getattr(keras_layer, attribute, None)
            if variable is not None:
                table[f"{name}.{neutral}"] = variable
    return table


def load_neutral(model: keras.Model, plan: Plan, weights: Mapping[str, np.ndarray]) -> None:
    """Assign neutral weights to the model (native models take their Keras variable paths).

    Outside a replica this writes every mirrored copy, on every device."""
    variables = _neutral_variables(model, plan)
    unknown = sorted(set(weights) - set(variables))
    if unknown:
        raise KeyError(f"no variable for weights {unknown} in the tf model")
    for name, value in weights.items():
        variable = variables[name]
        array = np.asarray(value, dtype=np.float32)
        if tuple(variable.shape) != array.shape:
            raise ValueError(f"{name}: shape {list(array.shape)} does not fit {list(variable.shape)}")
        variable.assign(array)


def neutral_state(model: keras.Model, plan: Plan) -> dict[str, np.ndarray]:
    """The model's weights under neutral names and channels-last layouts, as float32 numpy."""
    return {
        name: np.asarray(variable.numpy(), dtype=np.float32)
        for name, variable in _neutral_variables(model, plan).items()
    }


def per_row_loss(name: str, outputs: Any, targets: Any) -> Any:
    """Loss of each row, in float32: cross-entropy on logits, or MSE averaged over outputs."""
    outputs = tf.cast(outputs, tf.float32)
    if name == "cross_entropy":
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=outputs)
    return tf.reduce_mean(tf.square(outputs - targets), axis=1)
