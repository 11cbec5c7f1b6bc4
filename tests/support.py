"""Helpers for tests that read what a real run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def step_losses(run_dir: Path) -> np.ndarray:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return np.array([record["loss"] for record in map(json.loads, lines) if "loss" in record])


def summary(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


def max_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))
