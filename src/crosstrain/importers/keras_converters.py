"""Converters of the Keras importer, part one: weights and option checks, activations,
dense layers and convolutions, pooling, shapes, rescaling and dropout. The table that
keys them by Keras class is :data:`crosstrain.importers.keras_table.CONVERTERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs
import keras
import numpy as np

from crosstrain.core.model import layers as neutral
from crosstrain.core.model.layers import (
    AvgPool2D,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool2D,
    Layer,
    LayerScale,
    LeakyReLU,
    MaxPool2D,
    Mean,
    ReLU,
    ReLU6,
    Rescale,
    Reshape,
    Softmax,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.model.layers.activations import ACTIVATIONS
from crosstrain.importers.common import Conversion, Piece, Weights
from crosstrain.importers.keras_calls import Call


def _array(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)


def _kernel_and_bias(call: Call, kernel: Any) -> Weights:
    weights = {"kernel": _array(kernel)}
    if call.config.get("use_bias", True):
        weights["bias"] = _array(call.operation.bias)
    return weights


def _channels_last(call: Call) -> None:
    call.option("data_format", ("channels_last", None), "a plan is channels-last")


def _padding(call: Call) -> Literal["valid", "same"]:
    padding = call.config["padding"]
    if padding not in ("valid", "same"):
        raise call.refuse(f"padding={padding!r}: a plan's convolutions pad 'valid' or 'same'")
    return "valid" if padding == "valid" else "same"


def _last_axis(call: Call, key: str = "axis") -> None:
    """``axis`` (or its list of one) is the last one: -1, or the input's rank."""
    value = call.config.get(key, -1)
    axes = list(value) if isinstance(value, list | tuple) else [value]
    rank = len(call.input_shapes[0]) + 1
    if len(axes) != 1 or axes[0] not in (-1, rank - 1):
        raise call.refuse(f"{key}={value!r}: the plan's layer acts on the last axis")


def _no_lora(call: Call) -> None:
    if call.config.get("lora_rank"):
        raise call.refuse(f"lora_rank={call.config['lora_rank']}: merge the LoRA weights first")
    if call.config.get("quantization_config") is not None:
        raise call.refuse("quantization_config: a quantized layer's weights are not float kernels")


#: Keras's activation names: the plan layers that compute each, in order. Those that are
#: also the name of a plan ``activation`` (core's ACTIVATIONS, with the same meaning) stay
#: ``activation = NAME`` on a dense or convolution. Core's classes are written ``neutral.X``,
#: so a new row needs no import.
ACTIVATION_LAYERS: dict[str, tuple[Layer, ...]] = {
    "linear": (),
    "relu": (neutral.ReLU(),),
    "relu6": (neutral.ReLU6(),),
    "sigmoid": (neutral.Sigmoid(),),
    "tanh": (neutral.Tanh(),),
    "gelu": (neutral.GELU(),),  # Keras's default is the exact (erf) one, as the plan's
    "silu": (neutral.SiLU(),),
    "swish": (neutral.SiLU(),),
    "hard_silu": (neutral.HardSwish(),),
    "hard_swish": (neutral.HardSwish(),),
    "leaky_relu": (neutral.LeakyReLU(negative_slope=0.2),),  # the activation's slope, not the layer's
    "softmax": (neutral.Softmax(),),
    # relu6(x + 3) / 6, as Keras computes it (the division as a product: one rounding apart)
    "hard_sigmoid": (
        neutral.Rescale(scale=1.0, offset=3.0),
        neutral.ReLU6(),
        neutral.Rescale(scale=1.0 / 6.0),
    ),
}


def _activation_name(call: Call, key: str = "activation") -> str:
    value = call.config.get(key, "linear")
    if value is None:
        return "linear"
    if not isinstance(value, str):
        raise call.refuse(f"{key}: a custom activation function has no plan equivalent")
    if value not in ACTIVATION_LAYERS:
        raise call.refuse(f"activation {value!r} has no plan equivalent")
    return value


def _activation_pieces(name: str, suffix: str) -> Conversion:
    layers = ACTIVATION_LAYERS[name]
    return tuple(
        Piece(layer, suffix=f"{suffix}_{index}" if index < len(layers) - 1 else suffix)
        for index, layer in enumerate(layers)
    )


WithActivation = Dense | Conv2D | Conv1D | Conv2DTranspose


def _with_activation(call: Call, layer: WithActivation, weights: Weights) -> Conversion:
    """A dense or convolution and its ``activation``: the plan's field where it has the name
    with the same meaning, else the activation's layers after it."""
    name = _activation_name(call)
    if name == "linear":
        return (Piece(layer, weights),)
    if ACTIVATIONS.get(name) is not None and name != "softmax":
        return (Piece(attrs.evolve(layer, activation=name), weights),)
    # the layer is {name}_linear; the Keras name is its activation's output, which others read
    return (Piece(layer, weights, suffix="linear"), *_activation_pieces(name, ""))


def _activation(call: Call) -> Conversion:
    return _activation_pieces(_activation_name(call), "")


def _relu_layer(call: Call) -> Conversion:
    """Keras's ReLU layer: relu, relu6 (max_value 6) or leaky (negative_slope)."""
    config = call.config
    max_value, slope, threshold = (
        config.get("max_value"),
        config.get("negative_slope", 0.0),
        config.get("threshold", 0.0),
    )
    if threshold:
        raise call.refuse(f"threshold={threshold!r}: the plan's relu starts at 0")
    if max_value is None:
        return (Piece(LeakyReLU(negative_slope=float(slope)) if slope else ReLU()),)
    if float(max_value) == 6.0 and not slope:
        return (Piece(ReLU6()),)
    raise call.refuse(
        f"max_value={max_value!r} with negative_slope={slope!r}: the plan caps a relu only at 6"
    )


def _leaky_relu(call: Call) -> Conversion:
    return (Piece(LeakyReLU(negative_slope=float(call.config["negative_slope"]))),)


def _softmax(call: Call) -> Conversion:
    _last_axis(call)
    return (Piece(Softmax()),)


def _dense(call: Call) -> Conversion:
    _no_lora(call)
    dense = Dense(units=call.config["units"], use_bias=call.config["use_bias"])
    return _with_activation(call, dense, _kernel_and_bias(call, call.operation.kernel))


def _conv_options(call: Call) -> dict[str, Any]:
    _channels_last(call)
    _no_lora(call)
    config = call.config
    return {
        "kernel_size": tuple(config["kernel_size"]),
        "strides": tuple(config["strides"]),
        "padding": _padding(call),
        "use_bias": config["use_bias"],
        "dilation": tuple(config["dilation_rate"]),
    }


def _conv2d(call: Call) -> Conversion:
    options = _conv_options(call)
    conv = Conv2D(filters=call.config["filters"], groups=call.config.get("groups", 1), **options)
    return _with_activation(call, conv, _kernel_and_bias(call, call.operation.kernel))


def _conv1d(call: Call) -> Conversion:
    if call.config.get("padding") == "causal":
        raise call.refuse("padding='causal': a plan's conv1d pads 'valid' or 'same'")
    options = {
        key: value[0] if isinstance(value, tuple) else value for key, value in _conv_options(call).items()
    }
    conv = Conv1D(filters=call.config["filters"], groups=call.config.get("groups", 1), **options)
    return _with_activation(call, conv, _kernel_and_bias(call, call.operation.kernel))


def _depthwise(call: Call, kernel: Any, use_bias: bool) -> tuple[Conv1D | Conv2D, Weights]:
    """Keras's depthwise kernel [..., channels, multiplier] as a grouped convolution's
    [..., 1, channels * multiplier]: output channel c * multiplier + m reads channel c,
    in Keras's order and in a grouped convolution's."""
    options = _conv_options(call)
    channels = call.input_shapes[0][-1]
    multiplier = call.config["depth_multiplier"]
    values = _array(kernel)
    weights = {"kernel": values.reshape(*values.shape[:-2], 1, channels * multiplier)}
    if use_bias:
        weights["bias"] = _array(call.operation.bias)
    filters = channels * multiplier
    if len(options["kernel_size"]) == 1:
        flat = {key: value[0] if isinstance(value, tuple) else value for key, value in options.items()}
        return Conv1D(filters=filters, groups=channels, **{**flat, "use_bias": use_bias}), weights
    return Conv2D(filters=filters, groups=channels, **{**options, "use_bias": use_bias}), weights


def _depthwise_conv(call: Call) -> Conversion:
    if call.config.get("padding") == "causal":
        raise call.refuse("padding='causal': a plan's convolutions pad 'valid' or 'same'")
    layer, weights = _depthwise(call, call.operation.kernel, call.config["use_bias"])
    return _with_activation(call, layer, weights)


def _separable_conv(call: Call) -> Conversion:
    """A depthwise convolution (no bias), then a 1x1 convolution with the bias and activation."""
    depthwise, weights = _depthwise(call, call.operation.depthwise_kernel, use_bias=False)
    pointwise = Conv2D(filters=call.config["filters"], kernel_size=1, use_bias=call.config["use_bias"])
    pieces = _with_activation(call, pointwise, _kernel_and_bias(call, call.operation.pointwise_kernel))
    return (Piece(depthwise, weights, suffix="depthwise"), *pieces)


def _conv2d_transpose(call: Call) -> Conversion:
    _channels_last(call)
    config = call.config
    if config.get("output_padding") is not None:
        raise call.refuse(
            f"output_padding={config['output_padding']!r}: the plan's output sizes are Keras's defaults"
        )
    call.option("dilation_rate", ([1, 1], (1, 1)), "the plan's conv2d_transpose has no dilation")
    conv = Conv2DTranspose(
        filters=config["filters"],
        kernel_size=tuple(config["kernel_size"]),
        strides=tuple(config["strides"]),
        padding=_padding(call),
        use_bias=config["use_bias"],
    )
    return _with_activation(call, conv, _kernel_and_bias(call, call.operation.kernel))


def _pool(kind: type[MaxPool2D] | type[AvgPool2D]) -> Callable[[Call], Conversion]:
    def convert(call: Call) -> Conversion:
        _channels_last(call)
        size = tuple(call.config["pool_size"])
        strides = tuple(call.config["strides"] or size)
        if len(set(size)) != 1 or len(set(strides)) != 1:
            raise call.refuse(f"pool_size={size} strides={strides}: a plan's pools are square")
        stride = None if strides == size else strides[0]
        return (Piece(kind(pool_size=size[0], strides=stride, padding=call.config["padding"])),)

    return convert


def _global_avg_pool(axes: tuple[int, ...]) -> Callable[[Call], Conversion]:
    def convert(call: Call) -> Conversion:
        _channels_last(call)
        if call.config.get("keepdims"):
            return (Piece(Mean(axes=axes, keepdims=True)),)
        return (Piece(GlobalAvgPool2D() if len(axes) == 2 else Mean(axes=axes)),)

    return convert


def _flatten(call: Call) -> Conversion:
    _channels_last(call)
    return (Piece(Flatten()),)


def _reshape(call: Call) -> Conversion:
    return (Piece(Reshape(target_shape=tuple(call.config["target_shape"]))),)


def _permute(call: Call) -> Conversion:
    return (Piece(Transpose(perm=tuple(axis - 1 for axis in call.config["dims"]))),)


def _zero_pad(call: Call) -> Conversion:
    _channels_last(call)
    (top, bottom), (left, right) = call.config["padding"]
    return (Piece(ZeroPad2D(padding=((top, bottom), (left, right)))),)


def _crop(call: Call) -> Conversion:
    _channels_last(call)
    (top, bottom), (left, right) = call.config["cropping"]
    return (Piece(Crop2D(cropping=((top, bottom), (left, right)))),)


def _layer_scale(call: Call) -> Conversion:
    """keras.applications' ConvNeXt LayerScale, ``x * gamma`` over the last axis: a scale
    starting where the Keras layer started (``init_values``)."""
    (gamma,) = call.operation.weights
    return (Piece(LayerScale(initial=float(call.config["init_values"])), {"scale": _array(gamma)}),)


def _upsample(call: Call) -> Conversion:
    _channels_last(call)
    interpolation = call.config["interpolation"]
    return (Piece(UpSample2D(size=tuple(call.config["size"]), interpolation=interpolation)),)


def _rescaling(call: Call) -> Conversion:
    scale, offset = call.config["scale"], call.config["offset"]
    return (Piece(Rescale(scale=_number_or_channels(scale), offset=_number_or_channels(offset))),)


def _number_or_channels(value: Any) -> float | tuple[float, ...]:
    """A number, or one per channel (a vector of one repeated value is that value)."""
    values = np.asarray(value, np.float64).ravel()
    if not np.ptp(values):
        return float(values[0])
    return tuple(float(item) for item in values)


def _normalization(call: Call) -> Conversion:
    """``(x - mean) / max(sqrt(variance), eps)``, one mean and variance for every channel or
    one per channel of the last axis: a rescale by ``1 / std``, offset ``-mean / std``."""
    call.option("invert", False, "the plan has no inverse normalization")
    mean = np.asarray(keras.ops.convert_to_numpy(call.operation.mean), np.float64).ravel()
    variance = np.asarray(keras.ops.convert_to_numpy(call.operation.variance), np.float64).ravel()
    if np.ptp(mean) or np.ptp(variance):
        _last_axis(call)  # per channel: of the last axis, as the plan's rescale
    scale = 1.0 / np.maximum(np.sqrt(variance), keras.config.epsilon())
    offset = -mean * scale + 0.0
    return (Piece(Rescale(scale=_number_or_channels(scale), offset=_number_or_channels(offset))),)


def _dropout(call: Call) -> Conversion:
    noise_shape = call.config.get("noise_shape")
    rate = float(call.config["rate"])
    if noise_shape is None:
        return (Piece(Dropout(rate=rate)),)
    noise_shape = tuple(noise_shape)
    if noise_shape[:1] == (None,) and all(size == 1 for size in noise_shape[1:]):
        return (Piece(Dropout(rate=rate, per_row=True)),)  # stochastic depth: whole rows
    raise call.refuse(
        f"noise_shape={call.config['noise_shape']!r}: the plan's dropout drops single values "
        f"or whole rows (noise_shape=(None, 1, ...)), not whole channels"
    )
