"""Raw dicts (TOML, --set) to Plan and back, through cattrs, with messages that name fields.

Primitive hooks are strict on purpose: "5" is not an int and 1.5 is not silently
truncated, because a typo in a plan should fail here rather than train quietly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationNote

from crosstrain.core.data.augment import Augmentation
from crosstrain.core.errors import PlanError, did_you_mean
from crosstrain.core.model.layers import LAYER_TYPES, Layer
from crosstrain.core.model.layers.convolutions import as_padding2d
from crosstrain.core.spec.data_spec import DataSpec
from crosstrain.core.spec.plan import LossSpec, ModelSpec, NativeModel, OptimizerSpec, Plan, TrainSpec


def _strict_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _strict_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _int_or_pair(value: Any, _: type) -> tuple[int, int]:
    """kernel_size/strides: an int, or [height, width]."""
    if isinstance(value, list | tuple) and len(value) == 2:
        return (_strict_int(value[0], int), _strict_int(value[1], int))
    if isinstance(value, list | tuple):
        raise TypeError(f"expected an integer or [height, width], got {list(value)!r}")
    size = _strict_int(value, int)
    return (size, size)


def _padding_2d(value: Any, _: type) -> tuple[tuple[int, int], tuple[int, int]]:
    """zero_pad2d's padding: an int, [h, w] or [[top, bottom], [left, right]]."""
    if isinstance(value, list | tuple):
        value = [
            _int_or_pair(item, int) if isinstance(item, list | tuple) else _strict_int(item, int)
            for item in value
        ]
    else:
        value = _strict_int(value, int)
    return as_padding2d(value)


def _float_or_floats(value: Any, _: type) -> tuple[float, ...]:
    """data.mean/std: one number, or one per channel."""
    if isinstance(value, list | tuple):
        return tuple(_strict_float(item, float) for item in value)
    return (_strict_float(value, float),)


def _number_or_numbers(value: Any, _: type) -> float | tuple[float, ...]:
    """rescale's scale/offset: one number, or one per channel (a number stays a number, so
    the plans written before vectors hash as they did)."""
    if isinstance(value, list | tuple):
        return tuple(_strict_float(item, float) for item in value)
    return _strict_float(value, float)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook_func(lambda cls: cls == tuple[int, int], _int_or_pair)
    converter.register_structure_hook_func(lambda cls: cls == tuple[float, ...], _float_or_floats)
    converter.register_structure_hook_func(lambda cls: cls == float | tuple[float, ...], _number_or_numbers)
    converter.register_structure_hook_func(
        lambda cls: cls == tuple[tuple[int, int], tuple[int, int]], _padding_2d
    )
    # Predicates, not singledispatch: the hook must catch the base Layer only, or it
    # would also catch (and recurse into) each concrete layer class it structures.
    converter.register_structure_hook_func(lambda cls: cls is Layer, _structure_layer)
    converter.register_structure_hook(NativeModel, _structure_native)
    converter.register_unstructure_hook(NativeModel, lambda native: dict(native.factories))
    return converter


def _structure_layer(value: Any, _: type) -> Layer:
    if not isinstance(value, dict):
        raise TypeError(f"a layer is a table with a 'type', got {value!r}")
    fields = dict(value)
    kind = fields.pop("type", None)
    if kind not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {kind!r}{did_you_mean(str(kind), LAYER_TYPES)}")
    return _CONVERTER.structure(fields, LAYER_TYPES[kind])


def _unstructure_layer(layer: Layer) -> dict[str, Any]:
    fields = {"type": layer.type}
    fields.update(attrs.asdict(layer))
    # unset, these stay out of plan.json, so a plan that does not use them hashes as it
    # did before they existed (a run from then still resumes)
    for optional in ("name", "inputs", "activation"):
        if fields.get(optional) is None:
            fields.pop(optional, None)
    defaults = attrs.fields_dict(type(layer))
    for later in layer.later_fields:
        if getattr(layer, later) == defaults[later].default:
            fields.pop(later)
    return fields


def _default(cls: type, name: str) -> Any:
    return attrs.fields_dict(cls)[name].default


def _structure_native(value: Any, _: type) -> NativeModel:
    if isinstance(value, NativeModel):
        return value
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TypeError('native is a table of backend = "module:function"')
    return NativeModel(**value)


_CONVERTER = _make_converter()


def unstructure_plan(plan: Plan) -> dict[str, Any]:
    raw: dict[str, Any] = _CONVERTER.unstructure(plan)
    raw.pop("source", None)
    raw["model"]["layers"] = [_unstructure_layer(layer) for layer in plan.model.layers]
    raw["model"]["blocks"] = {
        name: {"layers": [_unstructure_layer(layer) for layer in block.layers]}
        for name, block in plan.model.blocks.items()
    }
    if raw["model"].get("native") is None:
        raw["model"].pop("native", None)
    for section, fields in _LEFT_OUT_UNSET.items():
        for field in fields:
            if raw[section].get(field) is None:
                raw[section].pop(field, None)
    for place, defaults in _LEFT_OUT_AT_DEFAULT.items():
        table = raw if place is None else raw[place]
        for name, default in defaults.items():
            if name in table and table[name] == default:
                table.pop(name)
    return raw


#: fields newer than the first plans: left out of plan.json while unset, so a run written
#: before they existed hashes as it did (and still resumes); a layer's activation likewise
_LEFT_OUT_UNSET = {
    "data": ("eval_x_key", "eval_y_key", "image_size", "label", "tokenizer", "cache"),
    "model": ("init",),
}
#: likewise, fields left out while at their default (section None: the plan's top level)
_LEFT_OUT_AT_DEFAULT: dict[str | None, dict[str, Any]] = {
    None: {"top_k": _default(Plan, "top_k")},
    "loss": {"label_smoothing": _default(LossSpec, "label_smoothing")},
    "optimizer": {"decay": _default(OptimizerSpec, "decay")},
    "model": {"width": 1.0},
    "train": {"shard": _default(TrainSpec, "shard")},
    "data": {
        "augment": attrs.asdict(Augmentation()),
        "features": [],
        "categorical": [],
        "standardize": False,
        "antialias": True,
    },
}


def structure_plan(raw: dict[str, Any], source: str | None = None, base_dir: Path | None = None) -> Plan:
    """Build a Plan from a raw dict; the first problem becomes a PlanError naming its field."""
    raw = dict(raw)
    raw.pop("source", None)
    try:
        plan = _CONVERTER.structure(raw, Plan)
    except ClassValidationError as error:
        field, message = _first_problem(error)
        raise PlanError(message, field=field or None, source=source) from None
    except (TypeError, ValueError) as error:
        raise PlanError(str(error), source=source) from None
    if base_dir is not None:
        plan = attrs.evolve(
            plan, data=_resolve_paths(plan.data, base_dir), model=_resolve_init(plan, base_dir)
        )
    return attrs.evolve(plan, source=source)


def _resolve_init(plan: Plan, base_dir: Path) -> ModelSpec:
    """``model.init`` is relative to the plan file, as the data paths are."""
    init = plan.model.init
    return plan.model if init is None else attrs.evolve(plan.model, init=str((base_dir / init).resolve()))


def _resolve_paths(data: DataSpec, base_dir: Path) -> DataSpec:
    """Data paths in a plan are relative to the plan file, not to where it is run from."""

    def resolve(path: str | None) -> str | None:
        return None if path is None else str((base_dir / path).resolve())

    paths = ("path", "eval_path", "x_path", "y_path", "eval_x_path", "eval_y_path", "tokenizer", "cache")
    resolved: dict[str, Any] = {name: resolve(getattr(data, name)) for name in paths}
    return attrs.evolve(data, **resolved)


_ATTRS_VALIDATOR_MESSAGE = re.compile(r"^'(\w+)' must be (.*)$", re.DOTALL)
_LITERAL_MESSAGE = re.compile(r"^(.*) not in literal typing\.Literal\[(.*)\]$")


def _first_problem(error: BaseException, path: str = "") -> tuple[str, str]:
    """Walk cattrs' nested exception group to the first leaf; return (field path, message)."""
    if isinstance(error, ForbiddenExtraKeysError):
        return _unknown_key(error, path)
    if isinstance(error, BaseExceptionGroup) and error.exceptions:
        # a misspelt required key is both missing and unknown: the unknown one says why
        unknown = [child for child in error.exceptions if isinstance(child, ForbiddenExtraKeysError)]
        child = unknown[0] if unknown else error.exceptions[0]
        note = _location_note(child)
        return _first_problem(child, _join(path, note))
    message = _describe_leaf(error)
    named = _ATTRS_VALIDATOR_MESSAGE.match(message)
    if named:  # attrs validators say "'lr' must be > 0: -1.0": move the name into the path
        return _join(path, named.group(1)), f"must be {named.group(2)}"
    return path, message


def _unknown_key(error: ForbiddenExtraKeysError, path: str) -> tuple[str, str]:
    """The first unknown key as the field, with the section's nearest key: every section's
    keys, and a layer's, are refused here and only here (the converter forbids extra keys)."""
    first, *others = sorted(error.extra_fields)
    known = [field.alias or field.name for field in attrs.fields(error.cl) if field.init]
    if error.cl is Plan:  # its source is where it was read from, not a key of the file
        known.remove("source")
    also = f" (also unknown: {', '.join(others)})" if others else ""
    return _join(path, first), f"unknown key{did_you_mean(first, known)}{also}"


def _location_note(error: BaseException) -> str:
    for note in getattr(error, "__notes__", []):
        if isinstance(note, IterableValidationNote):  # a list's index or a table's key
            return f"[{note.index}]" if isinstance(note.index, int) else str(note.index)
        name = getattr(note, "name", None)
        if name is not None:
            return f"[{name}]" if isinstance(name, int) else str(name)
        match = re.search(r"@ attribute (\w+)|@ index (\d+)", str(note))
        if match:
            return match.group(1) or f"[{match.group(2)}]"
    return ""


def _join(path: str, step: str) -> str:
    if not step:
        return path
    if step.startswith("[") or not path:
        return f"{path}{step}"
    return f"{path}.{step}"


def _describe_leaf(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return "is required"
    text = str(error)
    literal = _LITERAL_MESSAGE.match(text)
    if literal:
        return f"must be one of {literal.group(2)}, got {literal.group(1)!r}"
    return text or type(error).__name__
