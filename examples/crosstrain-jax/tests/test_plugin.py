"""The backend exists only through its entry point, and that entry point needs no jax."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from jaxtest_support import run_cli


def test_backends_lists_jax_from_its_own_distribution() -> None:
    result = run_cli("-p", "no:tf", "backends")  # skip importing tensorflow: seconds, not relevant
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if " jax " in line)
    import jax

    assert "crosstrain-jax" in row
    assert jax.__version__ in row
    assert "cpu" in row


def test_the_entry_point_and_strategy_import_without_jax() -> None:
    # None in sys.modules makes `import jax` fail, as if jax were not installed.
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import crosstrain_jax.launch, crosstrain_jax.plugin, crosstrain_jax.strategy\n"
        "from crosstrain.plugins.manager import backend_registry, make_plugin_manager\n"
        "entry = backend_registry(make_plugin_manager())['jax']\n"
        "print(entry.distribution, entry.strategy.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["crosstrain-jax", "JaxStrategy"]


def test_a_broken_jax_is_reported_not_raised(tmp_path: Path) -> None:
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('jaxlib is broken')\n")
    result = run_cli("-p", "no:tf", "backends", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if " jax " in line)
    assert "missing" in row and "crosstrain-jax" in row


def test_several_workers_are_refused_before_anything_starts(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    result = run_cli("run", str(write_plan()), "--backend", "jax", "--nproc", "2", "--workers", "2",
                     "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "multi-process jax (jax.distributed) is not supported" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

