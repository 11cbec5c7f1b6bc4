"""A plan's native model (``model.native``): the ``"module:function"`` factory each backend
imports, from beside the plan file as a script would."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.core.errors import PlanError
from crosstrain.core.spec.plan import Plan


def native_factory(plan: Plan, backend: str) -> Callable[[Plan], Any]:
    """Resolve the plan's ``"module:function"`` native model factory for ``backend``."""
    assert plan.model.native is not None
    target = plan.model.native.factory_for(backend)
    if target is None:
        raise PlanError(
            f"the native model names no factory for backend {backend!r}",
            field="model.native",
            source=plan.source,
        )
    module_name, _, function_name = target.partition(":")
    _put_plan_folder_on_path(plan)
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise PlanError(
            f"cannot load {target!r}: {error}", field=f"model.native.{backend}", source=plan.source
        ) from None
    if not callable(factory):
        raise PlanError(f"{target!r} is not callable", field=f"model.native.{backend}", source=plan.source)
    return factory  # type: ignore[no-any-return]


def _put_plan_folder_on_path(plan: Plan) -> None:
    """A module beside the plan file imports as it would beside a script run with python:
    the plan's folder comes first on the worker's import path."""
    if plan.source is None or not Path(plan.source).is_file():
        return
    folder = str(Path(plan.source).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
