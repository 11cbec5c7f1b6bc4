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



def test_several_machines_or_an_outside_launchers_group_are_refused_before_anything_starts(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """The example backend runs on one machine: --nnodes 2, or two srun tasks that would
    otherwise train as two separate jobs, is one line and exit 2 (crosstrain's SpansNodes)."""
    plan, out = str(write_plan()), str(tmp_path / "run")
    result = run_cli("run", plan, "--backend", "jax", "--nproc", "2", "--nnodes", "2",
                     "--rdzv-endpoint", "127.0.0.1:29400", "--out", out)
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (
        2, "crosstrain: error: --nnodes 2: the jax backend runs on one machine"
    )
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "5",
             "SLURM_JOB_NAME": "train"}
    result = run_cli("run", plan, "--backend", "jax", "--out", out, env=slurm)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "crosstrain: error: the SLURM environment (SLURM_NTASKS=2), but the jax backend runs "
        "on one machine in one launch: run it once, outside that launcher"
    )
    assert not (tmp_path / "run").exists()
