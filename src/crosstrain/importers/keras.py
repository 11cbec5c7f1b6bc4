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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import keras

from crosstrain.core.errors import InputError
from crosstrain.core.model.graph import INPUT_NAME
from crosstrain.core.model.layers import (
    DType,
    Layer,
    Shape,
)
from crosstrain.importers.common import (
    PREVIOUS,
    Conversion,
    ImportedModel,
    ImportResult,
    Weights,
    write_import,
)
from crosstrain.importers.keras_calls import Call, ImportRefused, TensorRef
from crosstrain.importers.keras_table import CONVERTERS, NO_EQUIVALENT


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
    calls = _calls(graph, config)
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


def _calls(graph: Any, config: Mapping[str, Any]) -> list[Call]:
    """The graph's calls in its config's order, a model used as a layer opened in place."""
    operations = {operation.name: operation for operation in graph.operations}
    calls: list[Call] = []
    for entry in config["layers"]:
        if entry["class_name"] == "InputLayer":
            continue
        call = _call(entry, operations[entry["name"]])
        calls.extend(_inlined(call) if isinstance(call.operation, keras.Model) else [call])
    return calls


def _inlined(call: Call) -> list[Call]:
    """A Sequential or Functional model called as a layer (ConvNeXt's stem), as its own
    calls: those that read its input read what the call reads, and its name then stands for
    its output (an identity call after them, which the plan leaves out)."""
    if len(call.inputs) != 1:
        raise call.refuse(
            f"a model inside the model called on {len(call.inputs)} tensors; a plan layer reads one"
        )
    try:
        inner = _functional(call.operation)
    except InputError as error:
        raise call.refuse(f"a model inside the model: {error}") from None
    config = inner.get_config()
    inputs, outputs = _ends(config["input_layers"]), _ends(config["output_layers"])
    if len(inputs) != 1 or len(outputs) != 1:
        raise call.refuse(
            f"a model inside the model with {len(inputs)} inputs and {len(outputs)} outputs; "
            f"a plan layer reads one tensor and gives one"
        )
    outer = call.inputs[0]
    calls = [_reading(inner_call, inputs[0][0], outer) for inner_call in _calls(inner, config)]
    inner_output = TensorRef(outputs[0][0], tuple(inner.outputs[0].shape[1:]))
    passes_through = Call(
        name=call.name,
        class_name="keras.layers.Identity",
        config={},
        operation=call.operation,
        arguments=(inner_output,),
        kwargs={},
    )
    return [*calls, passes_through]


def _reading(call: Call, inner_input: str, outer: TensorRef) -> Call:
    """``call`` with its reads of a nested model's input made reads of what feeds the model."""

    def moved(argument: Any) -> Any:
        return outer if isinstance(argument, TensorRef) and argument.source == inner_input else argument

    return attrs.evolve(
        call,
        arguments=tuple(moved(argument) for argument in call.arguments),
        kwargs={key: moved(value) for key, value in call.kwargs.items()},
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
        call_sources = sources
        if pieces[0].layer.arity == 1 and pieces[0].reads is None:  # self-attention's query,
            if len(set(sources)) != 1:  # value (and key): one tensor
                raise call.refuse(f"reads {len(set(sources))} tensors; its plan layer reads one")
            sources = sources[:1]
        for piece in pieces:
            name = f"{call.name}_{piece.suffix}" if piece.suffix else call.name
            if any(layer.name == name for layer in self.layers):
                raise call.refuse(f"its plan layer would be named {name!r}, which another layer has")
            if piece.reads is not None:
                sources = [sources[0] if read == PREVIOUS else call_sources[read] for read in piece.reads]
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
        from crosstrain.core.model.graph import build_graph

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
