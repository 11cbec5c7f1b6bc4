"""Converters of the Keras importer, part two (normalisation, sequences, merges and ops on
Keras tensors), and the table of every converter by Keras class: :data:`CONVERTERS`, with
:data:`NO_EQUIVALENT`, the reasons a class known not to import is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from crosstrain.core.model.layers import (
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Concat,
    Embedding,
    LayerNorm,
    MaxPool2D,
    Multiply,
    Rescale,
    Take,
)
from crosstrain.importers.common import PREVIOUS, Conversion, Piece, Weights
from crosstrain.importers.keras_calls import Call, Converter, TensorRef
from crosstrain.importers.keras_converters import (
    _activation,
    _array,
    _conv1d,
    _conv2d,
    _conv2d_transpose,
    _crop,
    _dense,
    _depthwise_conv,
    _dropout,
    _flatten,
    _global_avg_pool,
    _last_axis,
    _layer_scale,
    _leaky_relu,
    _no_lora,
    _normalization,
    _permute,
    _pool,
    _relu_layer,
    _rescaling,
    _reshape,
    _separable_conv,
    _softmax,
    _upsample,
    _zero_pad,
)


def _batchnorm(call: Call) -> Conversion:
    _last_axis(call)
    call.option("renorm", False, "the plan's batchnorm has no batch renormalization")
    layer = call.operation
    norm = BatchNorm(
        momentum=float(call.config["momentum"]),
        epsilon=float(call.config["epsilon"]),
        scale=bool(call.config["scale"]),
        center=bool(call.config["center"]),
    )
    weights = {"moving_mean": _array(layer.moving_mean), "moving_variance": _array(layer.moving_variance)}
    if norm.scale:
        weights["scale"] = _array(layer.gamma)
    if norm.center:
        weights["offset"] = _array(layer.beta)
    return (Piece(norm, weights),)


def _layernorm(call: Call) -> Conversion:
    _last_axis(call)
    for key in ("center", "scale"):
        call.option(key, True, "the plan's layernorm trains both its scale and offset")
    call.option("rms_scaling", False, "an RMS norm is not the plan's layernorm")
    layer = call.operation
    weights = {"scale": _array(layer.gamma), "offset": _array(layer.beta)}
    return (Piece(LayerNorm(eps=float(call.config["epsilon"])), weights),)


def _embedding(call: Call) -> Conversion:
    call.option("mask_zero", False, "the plan has no padding mask")
    _no_lora(call)
    table = Embedding(vocab_size=call.config["input_dim"], units=call.config["output_dim"])
    return (Piece(table, {"table": _array(call.operation.embeddings)}),)


#: MultiHeadAttention's mask arguments: read by its converter only to refuse them by name
MASKS = ("attention_mask", "query_mask", "value_mask", "key_mask")


def _attention(call: Call) -> Conversion:
    """Self-attention whose heads split the features (``num_heads * key_dim`` = features):
    Keras's [features, heads, key_dim] projections are the plan's [features, features]."""
    config = call.config
    query = call.inputs[0]
    key = call.kwargs.get("key", call.inputs[2] if len(call.inputs) > 2 else None)
    sources = [ref.source for ref in (*call.inputs, *([key] if isinstance(key, TensorRef) else []))]
    if len(set(sources)) != 1:
        raise call.refuse(
            f"query, value and key come from {sorted(set(sources))}: the plan's attention is self-attention"
        )
    features = query.shape[-1]
    heads, key_dim = config["num_heads"], config["key_dim"]
    if heads * key_dim != features:
        raise call.refuse(
            f"num_heads={heads} x key_dim={key_dim} = {heads * key_dim} differs from the {features} "
            f"input features: the plan's attention splits the features into its heads"
        )
    call.option("value_dim", (key_dim, None), "the plan's attention gives values the keys' width")
    call.option("output_shape", None, "the plan's attention keeps the input's width")
    call.option("dropout", 0.0, "the plan's attention drops no attention weights (add a dropout after it)")
    masks = [key for key in MASKS if call.kwargs.get(key) is not None]
    if masks:
        raise call.refuse(
            f"called with {masks[0]}: the plan's attention takes no mask but causal "
            f"(use_causal_mask=True) and a padding mask of token ids (not imported from Keras)"
        )
    call.option("attention_axes", (None, [1], [-2]), "the plan attends over the sequence axis")
    call.option("use_gate", False, "the plan's attention has no gate")
    call.option("sliding_window", None, "the plan's attention sees every position")
    if call.kwargs.get("return_attention_scores"):
        raise call.refuse("return_attention_scores=True: a plan layer has one output")
    layer = call.operation
    projections = {
        "query": layer.query_dense,
        "key": layer.key_dense,
        "value": layer.value_dense,
        "output": layer.output_dense,
    }
    use_bias = bool(config.get("use_bias", True))
    weights: Weights = {}
    for name, dense in projections.items():
        kernel = _array(dense.kernel)
        weights[f"{name}_kernel"] = kernel.reshape(features, features)
        if use_bias:
            weights[f"{name}_bias"] = _array(dense.bias).reshape(features)
    causal = bool(call.kwargs.get("use_causal_mask", False))
    attention = Attention(heads=heads, causal=causal, use_bias=use_bias)
    return (Piece(attention, weights),)


def _merge(kind: type[Add] | type[Multiply] | type[Concat]) -> Callable[[Call], Conversion]:
    def convert(call: Call) -> Conversion:
        if kind is Concat:
            _last_axis(call)
        return (Piece(kind()),)

    return convert


def _scaled_sum(call: Call) -> Conversion:
    """InceptionResNetV2's CustomScaleLayer, ``inputs[0] + inputs[1] * scale``: a rescale of
    the second input, then an add."""
    if len(call.inputs) != 2:
        raise call.refuse(f"reads {len(call.inputs)} tensors; the layer adds two")
    scaled = Piece(Rescale(scale=float(call.config["scale"])), suffix="scaled", reads=(1,))
    return (scaled, Piece(Add(), reads=(0, PREVIOUS)))


def _identity(call: Call) -> Conversion:
    return ()


def _op_with_scalar(op: str) -> Callable[[Call], Conversion]:
    """``x + c``, ``x - c``, ``x * c`` on a Keras tensor: a rescale; between two tensors, an
    add or multiply."""

    def convert(call: Call) -> Conversion:
        if len(call.inputs) == 2 and not call.constants and op in ("add", "multiply"):
            return (Piece(Add() if op == "add" else Multiply()),)
        if (
            len(call.inputs) != 1
            or len(call.constants) != 1
            or not isinstance(call.constants[0], int | float)
        ):
            raise call.refuse(
                f"{op} of {len(call.inputs)} tensors and {list(call.constants)}: "
                f"the plan takes one tensor and a number"
            )
        value = float(call.constants[0])
        if op == "subtract" and not isinstance(call.arguments[0], TensorRef):
            raise call.refuse("a number minus a tensor: the plan's rescale computes x * scale + offset")
        scale, offset = {"add": (1.0, value), "subtract": (1.0, -value), "multiply": (value, 0.0)}[op]
        return (Piece(Rescale(scale=scale, offset=offset)),)

    return convert


def _get_item(call: Call) -> Conversion:
    """``x[:, i]`` (and ``x[:, i, :, ...]``): one position of the first axis of each row, a
    take; any other index is refused."""
    key = call.constants
    whole = {"class_name": "__slice__", "config": {"start": None, "stop": None, "step": None}}
    position = key[1] if len(key) >= 2 else None
    if (
        len(call.inputs) != 1
        or key[:1] != (whole,)
        or not isinstance(position, int)
        or any(item != whole for item in key[2:])
    ):
        raise call.refuse(f"index {_shown_key(key)}: the plan takes one position, x[:, i]")
    return (Piece(Take(index=position)),)


def _shown_key(key: Sequence[Any]) -> str:
    """A GetItem key as Python writes it: [:, 0]."""
    shown = []
    for item in key:
        if isinstance(item, dict) and item.get("class_name") == "__slice__":
            bounds = {name: "" if value is None else str(value) for name, value in item["config"].items()}
            step = f":{bounds['step']}" if bounds["step"] else ""
            shown.append(f"{bounds['start']}:{bounds['stop']}{step}")
        else:
            shown.append(repr(item))
    return f"[{', '.join(shown)}]"


#: every Keras class that imports, by the config's module and class name: its converter and
#: the call arguments it honours
CONVERTERS: dict[str, Converter] = {
    "keras.layers.Dense": Converter(_dense),
    "keras.layers.Conv2D": Converter(_conv2d),
    "keras.layers.Conv1D": Converter(_conv1d),
    "keras.layers.DepthwiseConv2D": Converter(_depthwise_conv),
    "keras.layers.DepthwiseConv1D": Converter(_depthwise_conv),
    "keras.layers.SeparableConv2D": Converter(_separable_conv),
    "keras.layers.Conv2DTranspose": Converter(_conv2d_transpose),
    "keras.layers.MaxPooling2D": Converter(_pool(MaxPool2D)),
    "keras.layers.AveragePooling2D": Converter(_pool(AvgPool2D)),
    "keras.layers.GlobalAveragePooling2D": Converter(_global_avg_pool((0, 1))),
    "keras.layers.GlobalAveragePooling1D": Converter(_global_avg_pool((0,))),
    "keras.layers.Flatten": Converter(_flatten),
    "keras.layers.Reshape": Converter(_reshape),
    "keras.layers.Permute": Converter(_permute),
    "keras.layers.ZeroPadding2D": Converter(_zero_pad),
    "keras.layers.Cropping2D": Converter(_crop),
    "keras.layers.UpSampling2D": Converter(_upsample),
    "keras.layers.Rescaling": Converter(_rescaling),
    "keras.layers.Normalization": Converter(_normalization),
    "keras.layers.Activation": Converter(_activation),
    "keras.layers.ReLU": Converter(_relu_layer),
    "keras.layers.LeakyReLU": Converter(_leaky_relu),
    "keras.layers.Softmax": Converter(_softmax),
    "keras.layers.Dropout": Converter(_dropout),
    "keras.layers.BatchNormalization": Converter(_batchnorm),
    "keras.layers.LayerNormalization": Converter(_layernorm),
    "keras.layers.Embedding": Converter(_embedding),
    "keras.layers.MultiHeadAttention": Converter(
        _attention, frozenset({"key", "use_causal_mask", "return_attention_scores", *MASKS})
    ),
    "keras.layers.Add": Converter(_merge(Add)),
    "keras.layers.Multiply": Converter(_merge(Multiply)),
    "keras.layers.Concatenate": Converter(_merge(Concat)),
    "keras.layers.Identity": Converter(_identity),
    # keras.applications' own layers, by their module: no other class of those names
    "keras.src.applications.inception_resnet_v2.CustomScaleLayer": Converter(_scaled_sum),
    "keras.src.applications.convnext.LayerScale": Converter(_layer_scale),
    "keras.src.ops.numpy.Add": Converter(_op_with_scalar("add")),
    "keras.src.ops.numpy.Subtract": Converter(_op_with_scalar("subtract")),
    "keras.src.ops.numpy.Multiply": Converter(_op_with_scalar("multiply")),
    "keras.src.ops.numpy.GetItem": Converter(_get_item),
}


#: why some Keras classes have no plan equivalent (any other class: it has none)
NO_EQUIVALENT: dict[str, str] = {
    "Lambda": "runs Python code the plan cannot describe",
    "GlobalMaxPooling2D": "the plan has no maximum over positions",
    "GlobalMaxPooling1D": "the plan has no maximum over positions",
    "SpatialDropout2D": "the plan's dropout drops single values, not whole channels",
    "GroupNormalization": "the plan has no group normalization",
}
