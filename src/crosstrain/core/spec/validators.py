"""attrs validators the plan's sections share: each raises ValueError naming the field, which
:mod:`crosstrain.core.spec.plan_dicts` turns into a PlanError naming the plan file too."""

from __future__ import annotations

from typing import Any

import attrs


def ge0(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"'{attribute.name}' must be >= 0, got {value}")


def gt0(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"'{attribute.name}' must be > 0, got {value}")


def lt1(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value >= 1:
        raise ValueError(f"'{attribute.name}' must be < 1, got {value}")


def positive_sizes(instance: Any, attribute: attrs.Attribute[Any], value: tuple[int, ...] | None) -> None:
    if value is not None and any(size <= 0 for size in value):
        raise ValueError(f"'{attribute.name}' must be positive sizes, got {list(value)}")
