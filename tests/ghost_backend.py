"""A test plugin (`-p tests.ghost_backend`) registering a backend whose framework is missing,
and, with CROSSTRAIN_TEST_GHOST_NAME=torch, one that clashes with the built-in torch backend."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from crosstrain.core.run.job import World
from crosstrain.core.run.strategy import FrameworkStatus
from crosstrain.plugins.hookspecs import hookimpl


class GhostStrategy:
    name: ClassVar[str] = os.environ.get("CROSSTRAIN_TEST_GHOST_NAME", "ghost")
    install_hint: ClassVar[str] = "pip install 'crosstrain[ghost]'"
    world = World()

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        return FrameworkStatus(importable=False, problem="No module named 'ghostframework'")

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a backend whose framework is missing must never be used ({name})")


@hookimpl
def crosstrain_backends() -> list[type]:
    return [GhostStrategy]
