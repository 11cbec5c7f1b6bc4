"""`crosstrain compare` end to end: both frameworks, a verdict, and its exit code."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from crosstrain.plot import build_figure  # matplotlib: the plot extra, in dev
from tests.conftest import EXAMPLES, run_cli

pytestmark = pytest.mark.cross


def _compare(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "-p",
        "no:progress",
        "compare",
        str(EXAMPLES / "digits_mlp.toml"),
        "--backends",
        "torch,tf",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    )


def test_compare_agrees_across_frameworks(tmp_path: Path) -> None:
    result = _compare(tmp_path, "--set", "train.max_steps=30")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: AGREE" in result.stdout
    assert "max rel. step-loss" in result.stdout
    # the compare folder lists its runs, reference first, and plots as them
    listed = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert listed == [{"backend": "torch", "folder": "torch"}, {"backend": "tf", "folder": "tf"}]
    labels = [line.get_label() for line in build_figure([tmp_path]).axes[0].get_lines()]
    assert labels == [f"{tmp_path.name}/torch", f"{tmp_path.name}/tf"]


def test_compare_exits_non_zero_beyond_tolerance(tmp_path: Path) -> None:
    # bf16 rounds differently in each framework: far beyond a 1e-9 tolerance
    result = _compare(
        tmp_path, "--set", "train.max_steps=10", "--set", "train.precision='bf16'", "--tolerance", "1e-9"
    )
    assert result.returncode == 1
    assert "verdict: DISAGREE" in result.stdout
