"""A plan file read into a :class:`~crosstrain.core.spec.plan.Plan`: ``.toml`` (tomllib) or a
``.py`` file defining a module-level ``plan``, ``--set section.field=value`` overrides
applied to the raw tables, then structured (:mod:`crosstrain.core.spec.plan_dicts`) and validated.

It sits above both plan.py (the records and their checks) and convert.py (raw tables <->
records), so neither of those imports the other's caller.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from crosstrain.core.errors import PlanError
from crosstrain.core.spec.plan import Plan, validate_plan
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan


def load_plan(path: str | Path, overrides: Iterable[str] = ()) -> Plan:
    """Load, override and validate a plan file (.toml or .py)."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise PlanError("no such plan file", source=source)
    if path.suffix == ".toml":
        raw = _read_toml(path)
    elif path.suffix == ".py":
        raw = unstructure_plan(_read_python_plan(path))
    else:
        raise PlanError("a plan is a .toml or .py file", source=source)
    for override in overrides:
        apply_override(raw, override, source)
    plan = structure_plan(raw, source=source, base_dir=path.parent)
    validate_plan(plan)
    return plan


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise PlanError(f"not valid TOML: {error}", source=str(path)) from None


def _read_python_plan(path: Path) -> Plan:
    module_name = f"_crosstrain_plan_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PlanError("cannot import this file", source=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a user's file: any error it raises is reported, not crashed on
        raise PlanError(f"importing failed: {type(error).__name__}: {error}", source=str(path)) from None
    finally:
        sys.path.pop(0)
    plan = getattr(module, "plan", None)
    if not isinstance(plan, Plan):
        raise PlanError("a .py plan must define a module-level `plan = Plan(...)`", source=str(path))
    return plan


def apply_override(raw: dict[str, Any], override: str, source: str | None = None) -> None:
    """Apply ``section.field=value`` to the raw plan; the value is read as TOML if it can be.
    A list's entry is ``[index]`` (from 0; negative from the end), as errors name fields:
    ``model.layers[3].repeat=0``, ``model.blocks.stage.layers[0].filters=8``. A missing
    table on the way is created; a missing list entry is an error naming the field."""
    key, sep, text = override.partition("=")
    field = key.strip()
    if not sep or not field:
        raise PlanError(f"--set expects FIELD=VALUE, got {override!r}", source=source)
    steps = _field_steps(field, source)
    node: Any = raw
    for at, step in enumerate(steps[:-1]):
        node = _step_into(node, step, steps[at + 1], _shown(steps[: at + 1]), source)
    _assign(node, steps[-1], _parse_value(text.strip()), field, source)


_FIELD_PART = re.compile(r"^([^\[\]]+)((?:\[-?\d+\])*)$")


def _field_steps(field: str, source: str | None) -> list[str | int]:
    """``model.layers[3].repeat`` as ["model", "layers", 3, "repeat"]."""
    steps: list[str | int] = []
    for part in field.split("."):
        match = _FIELD_PART.match(part)
        if match is None:
            raise PlanError(
                f"--set: {part!r} is not a key or key[index] (as in model.layers[3].repeat)",
                field=field,
                source=source,
            )
        steps.append(match.group(1))
        steps += [int(index) for index in re.findall(r"-?\d+", match.group(2))]
    return steps


def _shown(steps: list[str | int]) -> str:
    """Steps back as the field they spell."""
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in steps).lstrip(".")


def _step_into(node: Any, step: str | int, next_step: str | int, walked: str, source: str | None) -> Any:
    """The table or list at ``step`` of ``node``, creating a missing table on the way."""
    if isinstance(step, str):
        if step not in node and isinstance(next_step, int):
            raise PlanError("no such list in the plan", field=walked, source=source)
        child = node.setdefault(step, {})
    else:
        child = node[_index(node, step, walked, source)]
    wanted, what = (dict, "a table") if isinstance(next_step, str) else (list, "a list")
    if not isinstance(child, wanted):
        raise PlanError(f"is not {what}", field=walked, source=source)
    return child


def _assign(node: Any, step: str | int, value: Any, field: str, source: str | None) -> None:
    if isinstance(step, str):
        node[step] = value
    else:
        node[_index(node, step, field, source)] = value


def _index(items: list[Any], index: int, field: str, source: str | None) -> int:
    if not -len(items) <= index < len(items):
        raise PlanError(f"no such entry: the list has {len(items)}", field=field, source=source)
    return index % len(items)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
