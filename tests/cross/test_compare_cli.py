"""`crosstrain compare` end to end: both frameworks, a verdict, and its exit code."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

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


# a compare that agrees (its verdict, its folder, its plot): tests/cross/test_agreement.py's
# examples, which run through `crosstrain compare`


def test_compare_exits_non_zero_beyond_tolerance(tmp_path: Path) -> None:
    # bf16 rounds differently in each framework: far beyond a 1e-9 tolerance
    result = _compare(
        tmp_path, "--set", "train.max_steps=10", "--set", "train.precision='bf16'", "--tolerance", "1e-9"
    )
    assert result.returncode == 1
    assert "verdict: DISAGREE" in result.stdout
