"""Small helpers shared by backends that need no framework: free ports, native factories."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable
from typing import Any

from crosstrain.core.errors import PlanError
from crosstrain.core.plan import Plan


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, chosen by the kernel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


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
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise PlanError(
            f"cannot load {target!r}: {error}", field=f"model.native.{backend}", source=plan.source
        ) from None
    if not callable(factory):
        raise PlanError(f"{target!r} is not callable", field=f"model.native.{backend}", source=plan.source)
    return factory  # type: ignore[no-any-return]
