"""crosstrain tune --lr on the digits MLP (Adam) on torch and on tf: each suggests a rate in
the range Adam trains this model well, from the same curve (the range test is a run like
any other: the same plan gives the same losses on both)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.plugins.metrics import read_metrics
from tests.conftest import EXAMPLES, run_cli

pytestmark = pytest.mark.cross


def test_the_range_test_suggests_a_rate_adam_trains_the_digits_mlp_with_on_both_frameworks(
    tmp_path: Path,
) -> None:
    curves = {}
    for backend in ("torch", "tf"):
        out = tmp_path / backend
        arguments = ("--lr", "--backend", backend, "--device", "cpu", "--out", str(out))
        result = run_cli("tune", str(EXAMPLES / "digits_mlp.toml"), *arguments)
        assert result.returncode == 0, result.stderr
        (line,) = [line for line in result.stdout.splitlines() if line.startswith("suggested optimizer.lr")]
        assert 3e-4 <= float(line.split()[3]) <= 3e-2, (backend, line)
        curves[backend] = np.array([record["loss"] for record in read_metrics(out) if "loss" in record])
    first = slice(0, 30)  # small rates: the curves agree to rounding before they climb
    assert np.max(np.abs(curves["tf"][first] / curves["torch"][first] - 1)) <= 1e-4
