"""What every importer shares, without a framework: a model made elsewhere, once converted to
plan layers and neutral weights (:class:`ImportedModel`), written as a readable TOML plan
with its weights beside it (``model.init``), then read back exactly as ``crosstrain run``
will read them, so a file that does not load is never left behind as a success."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import tomlkit
from tomlkit.items import Array, InlineTable

from crosstrain.core.admission.checks import check_init_from
from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.model.layers import DType, Layer, Shape, as_pair
from crosstrain.core.model.layers.convolutions import as_padding2d
from crosstrain.core.run.checkpoint import save_checkpoint
from crosstrain.core.spec.plan import ModelSpec, Plan, validate_plan
from crosstrain.core.spec.planfile import load_plan

#: where the weights go unless the caller names a file: beside the plan
DEFAULT_WEIGHTS = "init.safetensors"
#: a plan layer's weights by parameter name (``kernel``, ``bias``...), neutral layouts
Weights = dict[str, np.ndarray]


@attrs.frozen
class Piece:
    """A plan layer a converter makes (no name or inputs yet) and its weights by parameter.
    ``suffix`` names it ``{source name}_{suffix}``; the piece with none keeps the source
    layer's (a Keras layer's, an fx node's) name."""

    layer: Layer
    weights: Weights = attrs.field(factory=dict)
    suffix: str = ""
    #: what it reads when not the piece before it (the first: the source layer's inputs):
    #: the source layer's inputs by position, ``PREVIOUS`` the piece before's output
    #: (InceptionResNetV2's ``a + b * scale``: a rescale of input 1, then an add)
    reads: tuple[int, ...] | None = None


#: in :attr:`Piece.reads`: the output of the piece before
PREVIOUS = -1


#: a converter's answer: the pieces, run in order, the last one's output being the source
#: layer's; none at all passes the layer's input through
Conversion = tuple[Piece, ...]


@attrs.frozen
class ImportedModel:
    """A model converted to plan layers (each named, ``inputs`` where it is not the layer
    before) and its weights under their neutral names ``{layer name}.{param}``; ``origin``
    says what it came from, ``notes`` what changed on the way (both head the plan file)."""

    name: str
    input_shape: Shape
    input_dtype: DType
    layers: tuple[Layer, ...]
    weights: Mapping[str, np.ndarray]
    origin: str
    notes: tuple[str, ...] = ()


@attrs.frozen
class ImportResult:
    """What an import wrote: the plan, its weights, and the model's size."""

    plan: Path
    weights: Path
    layers: int
    parameters: int
    notes: tuple[str, ...]


def write_import(
    model: ImportedModel, out: str | Path, weights: str | Path | None = None, overwrite: bool = False
) -> ImportResult:
    """Write ``model`` as the plan ``out`` and its weights (default ``init.safetensors``
    beside it), after checking the plan and the weights against each other; read both back
    as a run would. Refuses to replace either file unless ``overwrite``."""
    plan_path = Path(out)
    weights_path = Path(weights) if weights is not None else plan_path.parent / DEFAULT_WEIGHTS
    _check_outputs(plan_path, weights_path, overwrite)
    init = Path(os.path.relpath(weights_path.resolve(), plan_path.parent.resolve())).as_posix()
    spec = ModelSpec(
        input_shape=model.input_shape, input_dtype=model.input_dtype, layers=model.layers, init=init
    )
    plan = Plan(model=spec, name=model.name, source=str(plan_path))
    try:
        validate_plan(plan)
    except PlanError as error:  # a converter made layers that do not fit: say which model
        raise InputError(f"{model.origin}: the imported plan does not check: {error}") from None
    _check_weights(plan, model.weights, model.origin)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    weights_path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(weights_path, model.weights, {"imported_from": model.origin})
    plan_path.write_text(plan_text(model, init), encoding="utf-8")
    written = load_plan(plan_path)
    if written.model.layers != model.layers:  # the file must say exactly what was converted
        raise AssertionError(f"{plan_path}: the written layers differ from the converted ones")
    check_init_from(weights_path, written, f"{plan_path}: model.init =")
    parameters = sum(math.prod(value.shape) for value in model.weights.values())
    return ImportResult(plan_path, weights_path, len(model.layers), parameters, model.notes)


def _check_outputs(plan_path: Path, weights_path: Path, overwrite: bool) -> None:
    if plan_path.suffix != ".toml":
        raise InputError(f"--out {plan_path}: the plan is written as TOML: give a .toml file")
    if weights_path.suffix != ".safetensors":
        raise InputError(f"--weights {weights_path}: the weights are written as a .safetensors file")
    for flag, path in (("--out", plan_path), ("--weights", weights_path)):
        if path.is_dir():
            raise InputError(f"{flag} {path}: is a folder")
        if path.exists() and not overwrite:
            raise InputError(f"{flag} {path}: exists; --overwrite replaces it")


def _check_weights(plan: Plan, weights: Mapping[str, np.ndarray], origin: str) -> None:
    """The converted weights are exactly the plan's, name by name and shape by shape."""
    needed = plan.model.graph().weight_specs()
    for name, spec in needed.items():
        found = weights.get(name)
        if found is None or tuple(found.shape) != spec.shape:
            shape = None if found is None else list(found.shape)
            raise InputError(
                f"{origin}: weight {name!r}: converted {shape}, the plan needs {list(spec.shape)}"
            )
    extra = sorted(set(weights) - set(needed))
    if extra:
        raise InputError(f"{origin}: weight {extra[0]!r} belongs to no layer of the plan")


# --------------------------------------------------------------------------- the plan's text


def plan_text(model: ImportedModel, init: str) -> str:
    """The plan as TOML: a comment saying where it came from and what changed, the name, and
    ``[model]`` with one inline table per layer (only fields away from their defaults)."""
    document = tomlkit.document()
    document.add(tomlkit.comment(f"Imported by crosstrain import from {model.origin}."))
    for note in model.notes:
        document.add(tomlkit.comment(note))
    document.add(
        tomlkit.comment(
            "To train it, add [data], [loss], [optimizer] and [train]: docs/plans.md, docs/import.md."
        )
    )
    document.add("name", model.name)
    section = tomlkit.table()
    section.add("input_shape", list(model.input_shape))
    if model.input_dtype != "float32":
        section.add("input_dtype", model.input_dtype)
    section.add("init", init)
    section["init"].comment("the imported weights, under neutral names (path relative to this file)")
    layers: Array = tomlkit.array()
    layers.multiline(True)
    for layer in model.layers:
        layers.append(layer_table(layer))
    section.add("layers", layers)
    document.add("model", section)
    return tomlkit.dumps(document)


def layer_table(layer: Layer) -> InlineTable:
    """One layer as a plan writes it: type, name, the fields that differ from their
    defaults (kernel sizes as one number when square), inputs last."""
    table = tomlkit.inline_table()
    table.append("type", layer.type)
    if layer.name is not None:
        table.append("name", layer.name)
    for field in attrs.fields(type(layer)):
        if field.name in ("name", "inputs"):
            continue
        value = getattr(layer, field.name)
        if field.default is not attrs.NOTHING and value == field.default:
            continue
        table.append(field.name, _written(value, field.converter))
    if layer.inputs is not None:
        table.append("inputs", list(layer.inputs))
    return table


_SHORTENED: dict[Callable[..., Any], Callable[[Any], Any]] = {
    as_pair: lambda pair: pair[0] if pair[0] == pair[1] else list(pair),
    as_padding2d: lambda sides: _padding(sides),
}


def _written(value: Any, converter: Any) -> Any:
    """A field's value in TOML's types: tuples as lists, a square pair as one number."""
    shorten = _SHORTENED.get(converter)
    if shorten is not None:
        return shorten(value)
    return _as_lists(value)


def _padding(sides: tuple[tuple[int, int], tuple[int, int]]) -> Any:
    """zero_pad2d's padding in its shortest form: an int, [h, w], or [[top, bottom], [left, right]]."""
    (top, bottom), (left, right) = sides
    if top == bottom and left == right:
        return top if top == left else [top, left]
    return [[top, bottom], [left, right]]


def _as_lists(value: Any) -> Any:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_as_lists(item) for item in value]
    return value
