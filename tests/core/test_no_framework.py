"""`import crosstrain` (and the whole core) imports no framework."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("torch", "tensorflow", "keras", "jax")


def test_import_crosstrain_imports_no_framework() -> None:
    code = (
        "import sys, crosstrain, crosstrain.cli, crosstrain.core.run.loop, crosstrain.plugins.manager\n"
        "import crosstrain.backends.torch.plugin, crosstrain.backends.torch.strategy\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
