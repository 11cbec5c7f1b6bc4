"""Readers of a run folder and the comparisons the suites make between runs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: Eval metrics at world N against world 1 (or between two layouts of the same model).
#: Counts and correct predictions are integers and must agree exactly; the summed loss is a
#: float64 sum of fp32 per-row losses, and CPU matrix kernels may round those rows a few
#: ulps (fp32: 2**-23 ~ 1.2e-7 each) differently when the same rows come in batches of
#: another shape, depending on the processor (docs/development.md has what each gave).
#: The relative error of a sum of non-negative terms is at most the largest per-row
#: relative error, so 1e-6 (eight ulps) bounds it with room and still catches a row
#: counted twice or dropped (>= 1/count, i.e. > 1e-3 on the test sets).
EVAL_LOSS_RELATIVE_TOLERANCE = 1e-6


def step_losses(run_dir: Path) -> np.ndarray:
    """Every optimizer step's loss, in order, from a run's metrics.jsonl."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return np.array([record["loss"] for record in map(json.loads, lines) if "loss" in record])


def summary(run_dir: Path) -> dict[str, Any]:
    """A run's summary.json."""
    return dict(json.loads((Path(run_dir) / "summary.json").read_text()))


def max_relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest |actual - expected| / |expected| over elements of equal-shaped arrays."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), 1e-12)))


def assert_same_eval(
    actual: Mapping[str, float],
    expected: Mapping[str, float],
    loss_tolerance: float = EVAL_LOSS_RELATIVE_TOLERANCE,
    flips: int = 0,
) -> None:
    """Eval metrics agree: the same metric names, exact counts, losses within
    ``loss_tolerance`` relative (see :data:`EVAL_LOSS_RELATIVE_TOLERANCE`), and at most
    ``flips`` predictions whose argmax differs. The same weights give the same hits (0 flips);
    weights trained apart by float rounding (another world size, another framework) may
    differ by a ulp where two logits nearly tie, so such comparisons allow one."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    assert actual["count"] == expected["count"], (actual, expected)
    if "accuracy" in expected:  # hits = accuracy x count
        flipped = abs(actual["accuracy"] - expected["accuracy"]) * expected["count"]
        assert flipped <= flips + 1e-6, (actual, expected)
    difference = abs(actual["loss"] - expected["loss"]) / max(abs(expected["loss"]), 1e-12)
    assert difference <= loss_tolerance, (actual, expected, difference)
