"""How `crosstrain compare` judges two runs (no framework needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from crosstrain.compare import BackendRun, compare_pair
from tests.conftest import EXAMPLES, run_cli


def _run(backend: str, losses: list[float], eval_loss: float = 0.5, accuracy: float = 0.9) -> BackendRun:
    summary = {"eval": {"loss": eval_loss, "accuracy": accuracy}}
    return BackendRun(backend, summary, np.array(losses))


def test_reports_the_worst_step_and_its_relative_difference() -> None:
    comparison = compare_pair(_run("torch", [2.0, 1.0, 0.5]), _run("tf", [2.0, 1.001, 0.5]))
    assert comparison.worst_step == 2
    assert abs(comparison.max_relative_loss_difference - 1e-3) < 1e-12
    assert comparison.agrees(tolerance=2e-3, accuracy_tolerance=0.01)
    assert not comparison.agrees(tolerance=1e-4, accuracy_tolerance=0.01)


def test_different_step_counts_never_agree() -> None:
    comparison = compare_pair(_run("torch", [1.0, 0.9]), _run("tf", [1.0]))
    assert not comparison.agrees(tolerance=1.0, accuracy_tolerance=1.0)


def test_eval_accuracy_gap_disagrees() -> None:
    comparison = compare_pair(_run("torch", [1.0], accuracy=0.90), _run("tf", [1.0], accuracy=0.95))
    assert not comparison.agrees(tolerance=1e-4, accuracy_tolerance=0.01)


def test_a_folder_reused_by_a_second_run_yields_the_last_run_only(tmp_path: Path) -> None:
    from crosstrain.compare import read_step_losses

    first = [{"step": s, "epoch": 0, "lr": 0.1, "loss": 9.0} for s in (1, 2, 3)]
    second = [{"step": s, "epoch": 0, "lr": 0.1, "loss": float(s)} for s in (1, 2)]
    evaluation = [{"step": 2, "epoch": 0, "eval": {"loss": 0.5}}]
    lines = [json.dumps(record) for record in first + second + evaluation]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert read_step_losses(tmp_path).tolist() == [1.0, 2.0]


def test_compare_without_the_metrics_plugin_says_why_not_in_one_line(tmp_path: Path) -> None:
    plan = str(EXAMPLES / "digits_mlp.toml")
    result = run_cli(
        "-p", "no:metrics", "compare", plan, "--backends", "torch,tf", "--out", str(tmp_path / "c")
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "crosstrain: error: compare reads each run's per-step losses from metrics.jsonl, which the "
        "'metrics' plugin writes: drop -p no:metrics"
    ]
    assert not (tmp_path / "c").exists()  # refused before anything is written
