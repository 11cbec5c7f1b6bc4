"""A plan file read into a :class:`~crosstrain.core.plan.Plan`: ``.toml`` (tomllib) or a
``.py`` file defining a module-level ``plan``, ``--set section.field=value`` overrides
applied to the raw tables, then structured (:mod:`crosstrain.core.convert`) and validated.

It sits above both plan.py (the records and their checks) and convert.py (raw tables <->
records), so neither of those imports the other's caller.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from crosstrain.core.convert import structure_plan, unstructure_plan
from crosstrain.core.errors import PlanError
from crosstrain.core.plan import Plan, validate_plan


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
    """Apply ``section.field=value`` to the raw plan; the value is read as TOML if it can be."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise PlanError(f"--set expects FIELD=VALUE, got {override!r}", source=source)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise PlanError(f"{part!r} is not a table", field=key.strip(), source=source)
        node = child
    node[parts[-1]] = _parse_value(text.strip())


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
