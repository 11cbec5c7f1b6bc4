"""A Keras 3 model (Sequential or Functional) as a plan and its weights.

Read through Keras's own description of the model: ``model.get_config()`` lists every layer
(and every op applied to a Keras tensor, as ``x + 3.0``) in an order where each comes after
what it reads, with each call's inbound tensors (``keras_history``: the layer that made
them), its other arguments and the per-row shapes; ``model.get_layer`` / ``operations`` give
the live objects whose weights are copied. Each Keras class has one converter in
:data:`CONVERTERS` (keyed by the config's ``module.class_name``, so a subclass of a Keras
layer, which may compute something else, is refused); a converter returns the plan layers
that compute the same thing and their weights under neutral names and layouts, or refuses
an option it cannot honour. Every refusal is one line naming the Keras layer's name, its
class and the option (:class:`ImportRefused`, exit 2).

The plan's loss reads logits, so a softmax that ends the model (``classifier_activation``)
is left out, with a note; the plan's outputs are the Keras model's before that softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import keras
import numpy as np

from crosstrain.core.errors import InputError
from crosstrain.core.graph import INPUT_NAME
from crosstrain.core.layers import (
    ACTIVATIONS,
    GELU,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Concat,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Dense,
    Dropout,
    DType,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    HardSwish,
    Layer,
    LayerNorm,
    LeakyReLU,
    MaxPool2D,
    Mean,
    Multiply,
    ReLU,
    ReLU6,
    Rescale,
    Reshape,
    Shape,
    Sigmoid,
    SiLU,
    Softmax,
    Take,
    Tanh,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.importers.common import Conversion, ImportedModel, ImportResult, Piece, Weights, write_import


class ImportRefused(InputError):
    """A Keras layer (or an option of one) that no plan layer computes."""


@attrs.frozen
class TensorRef:
    """A Keras tensor an argument names: the layer that made it and its per-row shape."""

    source: str
    shape: Shape


@attrs.frozen
class Call:
    """One call of a Keras layer or op in the model, as the model's config records it:
    ``inputs`` are the tensors among its positional arguments (in order, lists flattened),
    ``constants`` the other positional arguments (an op's ``3.0``)."""

    name: str
    class_name: str
    config: Mapping[str, Any]
    operation: Any  # the live keras Layer (or Operation), for its weights
    arguments: tuple[Any, ...]  # the positional arguments in order: TensorRefs and constants
    kwargs: Mapping[str, Any]

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return tuple(argument for argument in self.arguments if isinstance(argument, TensorRef))

    @property
    def constants(self) -> tuple[Any, ...]:
        return tuple(argument for argument in self.arguments if not isinstance(argument, TensorRef))

    @property
    def input_shapes(self) -> tuple[Shape, ...]:
        return tuple(ref.shape for ref in self.inputs)

    @property
    def shown_class(self) -> str:
        """The class as a user wrote it: ``Dense`` for Keras's layers, else module and class."""
        return self.class_name.removeprefix("keras.layers.")

    def refuse(self, problem: str) -> ImportRefused:
        return ImportRefused(f"keras layer {self.name!r} ({self.shown_class}): {problem}")

    def option(self, key: str, expected: Any, why: str) -> None:
        """Refuse unless config ``key`` is ``expected`` (a value, or a tuple of values)."""
        allowed = expected if isinstance(expected, tuple) else (expected,)
        value = self.config.get(key, allowed[0])
        if _plain(value) not in [_plain(item) for item in allowed]:
            raise self.refuse(f"{key}={value!r}: {why}")


@attrs.frozen
class Converter:
    """How one Keras class becomes plan layers; ``reads``: the call arguments it honours
    (any other one given a value is refused)."""

    convert: Callable[[Call], Conversion]
    reads: frozenset[str] = frozenset()


def import_keras(
    model: Any, out: str | Path, weights: str | Path | None = None, overwrite: bool = False
) -> ImportResult:
    """Write the Keras model ``model`` as the plan ``out`` (TOML) and its weights (default
    ``init.safetensors`` beside it, the plan's ``model.init``); return what was written."""
    return write_import(convert_model(model), out, weights, overwrite)


def import_file(
    path: str | Path, out: str | Path, weights: str | Path | None = None, overwrite: bool = False
) -> ImportResult:
    """``crosstrain import model.keras``: load the saved model with Keras, then import it."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"{source}: no such file")
    try:
        model = keras.saving.load_model(source, compile=False)
    except Exception as error:  # Keras's own reason (an unknown custom class, a torn file), one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{source}: Keras cannot load it: {first}") from None
    return import_keras(model, out, weights, overwrite)


def convert_model(model: Any) -> ImportedModel:
    """The Keras model as plan layers and neutral weights (nothing written)."""
    if not isinstance(model, keras.Model):
        raise InputError(f"expected a keras.Model, got {type(model).__name__}")
    graph = _functional(model)
    config = graph.get_config()
    inputs, outputs = _ends(config["input_layers"]), _ends(config["output_layers"])
    if len(inputs) != 1 or len(outputs) != 1:
        raise InputError(
            f"keras model {model.name!r}: has {len(inputs)} inputs and {len(outputs)} outputs; "
            f"a plan has one of each"
        )
    input_shape, input_dtype = _model_input(model, graph)
    operations = {operation.name: operation for operation in graph.operations}
    calls = [
        _call(entry, operations[entry["name"]])
        for entry in config["layers"]
        if entry["class_name"] != "InputLayer"
    ]
    output = outputs[0][0]
    calls = _ancestors(calls, output)
    notes: list[str] = []
    assembled = _Assembly()
    for call in calls:
        assembled.add(call, _converted(call, output, notes))
    assembled.check_shapes(input_shape, input_dtype, calls, tuple(graph.outputs[0].shape[1:]))
    return ImportedModel(
        name=model.name,
        input_shape=input_shape,
        input_dtype=input_dtype,
        layers=tuple(assembled.layers),
        weights=assembled.weights,
        origin=f"the Keras model {model.name!r} (Keras {keras.__version__})",
        notes=tuple(notes),
    )


def _ends(ends: Sequence[Any]) -> list[Sequence[Any]]:
    """A config's input_layers or output_layers as a list of [name, node, tensor]: Keras
    writes a model's single one without the enclosing list."""
    return [ends] if ends and isinstance(ends[0], str) else list(ends)


def _functional(model: Any) -> Any:
    """The model as a Functional graph: a built Sequential's layers, called in a chain."""
    if isinstance(model, keras.Sequential):
        if not model.built or not model.inputs:
            raise InputError(
                f"keras model {model.name!r}: a Sequential model needs a known input shape "
                f"(start it with keras.Input(shape=...)) to be imported"
            )
        return keras.Model(model.inputs, model.outputs, name=model.name)
    if not hasattr(model, "operations") or not model.inputs:
        raise InputError(
            f"keras model {model.name!r}: a subclassed model has no graph to read; "
            f"import a Sequential or Functional model"
        )
    return model


def _model_input(model: Any, graph: Any) -> tuple[Shape, DType]:
    tensor = graph.inputs[0]
    shape = tuple(tensor.shape[1:])
    if not shape or any(size is None for size in shape):
        raise InputError(
            f"keras model {model.name!r}: input shape {list(tensor.shape)} is not fixed; "
            f"build the model with keras.Input(shape=...) of known sizes"
        )
    dtype = str(tensor.dtype)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        return shape, "float32"
    if dtype in ("int32", "int64"):
        return shape, "int32"
    raise InputError(f"keras model {model.name!r}: input dtype {dtype}: a plan reads float32 or int32")


def _call(entry: Mapping[str, Any], operation: Any) -> Call:
    name = entry["name"]
    class_name = entry["class_name"]
    nodes = entry["inbound_nodes"]
    if len(nodes) != 1:
        raise ImportRefused(
            f"keras layer {name!r} ({class_name}): called {len(nodes)} times (shared weights); "
            f"a plan layer is called once"
        )
    node = nodes[0]
    arguments = [_tensor(argument, name, class_name) or argument for argument in _flat(node["args"])]
    kwargs = {key: _tensor(value, name, class_name) or value for key, value in node["kwargs"].items()}
    return Call(
        name=name,
        class_name=f"{entry['module']}.{class_name}",
        config=entry["config"],
        operation=operation,
        arguments=tuple(arguments),
        kwargs=kwargs,
    )


def _flat(arguments: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for argument in arguments:
        flat.extend(_flat(argument) if isinstance(argument, list | tuple) else [argument])
    return flat


def _tensor(argument: Any, name: str, class_name: str) -> TensorRef | None:
    if not (isinstance(argument, dict) and argument.get("class_name") == "__keras_tensor__"):
        return None
    source, _, index = argument["config"]["keras_history"]
    if index != 0:
        raise ImportRefused(
            f"keras layer {name!r} ({class_name}): reads output {index} of {source!r}; "
            f"a plan layer has one output"
        )
    return TensorRef(source, tuple(argument["config"]["shape"][1:]))


def _ancestors(calls: Sequence[Call], output: str) -> list[Call]:
    """The calls the output depends on, in the config's order (each after what it reads);
    a branch that leads nowhere else (an unused layer) is left out."""
    by_name = {call.name: call for call in calls}
    needed: set[str] = set()
    pending = [output]
    while pending:
        name = pending.pop()
        if name in needed or name not in by_name:
            continue
        needed.add(name)
        pending.extend(ref.source for ref in by_name[name].inputs)
        pending.extend(
            value.source for value in by_name[name].kwargs.values() if isinstance(value, TensorRef)
        )
    return [call for call in calls if call.name in needed]


def _converted(call: Call, output: str, notes: list[str]) -> Conversion:
    """The call's pieces: its converter's, a final softmax left out (with a note)."""
    if call.name == output and _is_softmax(call):
        notes.append(_SOFTMAX_NOTE.format(name=call.name, cls=call.shown_class))
        if "activation" in call.config and call.class_name != "keras.layers.Activation":
            call = attrs.evolve(call, config={**call.config, "activation": "linear"})
        else:
            return ()
    converter = CONVERTERS.get(call.class_name)
    if converter is None:
        reason = NO_EQUIVALENT.get(call.class_name.rpartition(".")[2], "has no plan equivalent")
        raise call.refuse(f"{reason} (what imports: docs/import.md)")
    for key, value in call.kwargs.items():
        if key not in converter.reads and key not in CALL_CONTEXT and value is not None:
            raise call.refuse(f"called with {key}={_shown(value)}, which the plan's layer cannot honour")
    try:
        return converter.convert(call)
    except ValueError as error:  # a core layer's own check (groups, shapes)
        raise call.refuse(str(error)) from None


#: call arguments the model's own call decides: Keras records ``training=False`` on every
#: call it traced, and replaces it with the model's ``training`` when the model runs (as a
#: plan's run does: training in its steps, not in evaluation)
CALL_CONTEXT = frozenset({"training"})

_SOFTMAX_NOTE = (
    "The Keras model's final softmax ({name!r}, {cls}) is left out: the plan's loss "
    "cross_entropy reads logits, so this plan's outputs are the logits before it."
)


def _is_softmax(call: Call) -> bool:
    if call.class_name == "keras.layers.Softmax":
        return True
    return bool(call.config.get("activation") == "softmax")


def _plain(value: Any) -> Any:
    """Config values as plain Python (tuples as lists) so that they compare."""
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def _shown(value: Any) -> str:
    return f"the tensor of {value.source!r}" if isinstance(value, TensorRef) else repr(value)


@attrs.define
class _Assembly:
    """The plan's layer list as it grows: each Keras name's plan name (a layer that passes
    its input through has its input's), the layers with names and inputs, the weights."""

    layers: list[Layer] = attrs.field(factory=list)
    weights: Weights = attrs.field(factory=dict)
    names: dict[str, str] = attrs.field(factory=dict)

    def add(self, call: Call, pieces: Conversion) -> None:
        sources = [self.names.get(ref.source, INPUT_NAME) for ref in call.inputs]
        if not pieces:
            if len(set(sources)) != 1:
                raise call.refuse("passes more than one input through")
            self.names[call.name] = sources[0]
            return
        if call.name == INPUT_NAME:
            raise call.refuse(
                f"the name {INPUT_NAME!r} is the plan's name of the model input; rename the layer"
            )
        if pieces[0].layer.arity == 1:  # self-attention's query, value (and key): one tensor
            if len(set(sources)) != 1:
                raise call.refuse(f"reads {len(set(sources))} tensors; its plan layer reads one")
            sources = sources[:1]
        for piece in pieces:
            name = f"{call.name}_{piece.suffix}" if piece.suffix else call.name
            if any(layer.name == name for layer in self.layers):
                raise call.refuse(f"its plan layer would be named {name!r}, which another layer has")
            inputs = self._inputs(sources)
            self.layers.append(attrs.evolve(piece.layer, name=name, inputs=inputs))
            self.weights.update({f"{name}.{param}": value for param, value in piece.weights.items()})
            sources = [name]
        self.names[call.name] = sources[0]

    def _inputs(self, sources: Sequence[str]) -> tuple[str, ...] | None:
        """``inputs`` only where the layer reads something other than the layer before."""
        before = self.layers[-1].name if self.layers else INPUT_NAME
        return None if list(sources) == [before] else tuple(sources)

    def check_shapes(
        self, input_shape: Shape, input_dtype: DType, calls: Sequence[Call], output_shape: Shape
    ) -> None:
        """Each Keras layer's output shape, as Keras recorded it, is its plan layer's: a
        converter that missed an option would show here, not in a wrong forward."""
        from crosstrain.core.graph import build_graph

        graph = build_graph(input_shape, self.layers, None, input_dtype)
        shapes = {node.path: node.output_shape for node in graph.nodes}
        keras_shapes = {ref.source: ref.shape for call in calls for ref in call.inputs}
        keras_shapes[calls[-1].name] = output_shape
        for call in calls:
            plan_name = self.names[call.name]
            ours = shapes.get(plan_name, input_shape)
            theirs = keras_shapes.get(call.name)
            if theirs is not None and tuple(theirs) != tuple(ours):
                raise call.refuse(f"its plan layers give shape {list(ours)}, Keras's gives {list(theirs)}")


# --------------------------------------------------------------------------- weights and options


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


# --------------------------------------------------------------------------- activations

#: Keras's activation names: the plan layers that compute each, in order. Those that are
#: also the name of a plan ``activation`` (core's ACTIVATIONS, with the same meaning) stay
#: ``activation = NAME`` on a dense or convolution.
ACTIVATION_LAYERS: dict[str, tuple[Layer, ...]] = {
    "linear": (),
    "relu": (ReLU(),),
    "relu6": (ReLU6(),),
    "sigmoid": (Sigmoid(),),
    "tanh": (Tanh(),),
    "gelu": (GELU(),),  # Keras's default is the exact (erf) one, as the plan's
    "silu": (SiLU(),),
    "swish": (SiLU(),),
    "hard_silu": (HardSwish(),),
    "hard_swish": (HardSwish(),),
    "leaky_relu": (LeakyReLU(negative_slope=0.2),),  # the activation's slope, not the layer's
    "softmax": (Softmax(),),
    # relu6(x + 3) / 6, as Keras computes it (the division as a product: one rounding apart)
    "hard_sigmoid": (Rescale(scale=1.0, offset=3.0), ReLU6(), Rescale(scale=1.0 / 6.0)),
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


# --------------------------------------------------------------------------- dense and convolutions


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


# --------------------------------------------------------------------------- pooling and shapes


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


# --------------------------------------------------------------------------- normalisation and sequences


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
    call.option("value_dim", (key_dim, None), "the plan's values have the keys' width")
    call.option("use_bias", True, "the plan's attention has biases")
    call.option("output_shape", None, "the plan's attention keeps the input's width")
    call.option("dropout", 0.0, "the plan's attention drops no attention weights")
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
    weights: Weights = {}
    for name, dense in projections.items():
        kernel = _array(dense.kernel)
        weights[f"{name}_kernel"] = kernel.reshape(features, features)
        weights[f"{name}_bias"] = _array(dense.bias).reshape(features)
    attention = Attention(heads=heads, causal=bool(call.kwargs.get("use_causal_mask", False)))
    return (Piece(attention, weights),)


# --------------------------------------------------------------------------- merges and ops


def _merge(kind: type[Add] | type[Multiply] | type[Concat]) -> Callable[[Call], Conversion]:
    def convert(call: Call) -> Conversion:
        if kind is Concat:
            _last_axis(call)
        return (Piece(kind()),)

    return convert


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
        _attention, frozenset({"key", "use_causal_mask", "return_attention_scores"})
    ),
    "keras.layers.Add": Converter(_merge(Add)),
    "keras.layers.Multiply": Converter(_merge(Multiply)),
    "keras.layers.Concatenate": Converter(_merge(Concat)),
    "keras.layers.Identity": Converter(_identity),
    "keras.src.ops.numpy.Add": Converter(_op_with_scalar("add")),
    "keras.src.ops.numpy.Subtract": Converter(_op_with_scalar("subtract")),
    "keras.src.ops.numpy.Multiply": Converter(_op_with_scalar("multiply")),
    "keras.src.ops.numpy.GetItem": Converter(_get_item),
}

#: why some Keras classes have no plan equivalent (any other class: it has none)
NO_EQUIVALENT: dict[str, str] = {
    "Functional": "a model inside the model: import the inner model, or build one flat model",
    "Sequential": "a model inside the model: import the inner model, or build one flat model",
    "Lambda": "runs Python code the plan cannot describe",
    "GlobalMaxPooling2D": "the plan has no maximum over positions",
    "GlobalMaxPooling1D": "the plan has no maximum over positions",
    "Cropping2D": "the plan has no cropping layer",
    "SpatialDropout2D": "the plan's dropout drops single values, not whole channels",
    "GroupNormalization": "the plan has no group normalization",
}
