"""crosstrain tune on the momentum backend (crosstrain.testing.null), in pytest's process:
the range test's rate rises exponentially, the run stops once the loss diverges, the
suggestion lies where the loss falls fastest, and --write copies the plan with it; --batch
is refused in one line where there is no GPU."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins.metrics import read_metrics
from crosstrain.tuning.batch import largest_micro_batch, split_global_batch
from tests.conftest import InProcessCli

NULL = ("-p", "crosstrain.testing.null")


def test_the_range_test_stops_at_divergence_and_writes_the_suggested_rate(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    plan, out, written = write_plan(), tmp_path / "tune", tmp_path / "tuned.toml"
    arguments = ("--lr", "--backend", "momentum", "--out", str(out), "--write", str(written))
    result = cli_in_process(*NULL, "tune", str(plan), *arguments)
    assert result.returncode == 0, result.stderr
    steps = [record for record in read_metrics(out) if "loss" in record]
    rates = [record["lr"] for record in steps]
    assert rates[0] == pytest.approx(1e-6) and all(b > a for a, b in itertools.pairwise(rates))
    assert rates[1] / rates[0] == pytest.approx((1e6) ** (1 / 99))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["reason"].startswith("the loss diverged at step ")  # before the 100th
    assert len(steps) == summary["steps"] < 100
    suggested = load_plan(written).optimizer.lr
    assert f"suggested optimizer.lr = {suggested:.3g}" in result.stdout
    assert 1e-3 < suggested < 0.2  # where the momentum model's loss falls fastest
    assert (out / "lr_range.png").stat().st_size > 0
    # the copy is the plan, its comments and every other field kept
    assert written.read_text().replace(f"lr = {suggested}", "lr = 0.05") == plan.read_text()


def test_the_batch_search_is_refused_without_a_gpu(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    arguments = ("--batch", "--device", "cpu", "--out", str(tmp_path))
    result = cli_in_process(*NULL, "tune", str(write_plan()), *arguments)
    assert result.returncode == 2
    assert result.stderr.startswith("crosstrain: error: tune --batch finds what fits a GPU's memory")
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_batch_search_doubles_then_bisects_and_keeps_the_global_batch() -> None:
    tried: list[int] = []

    def fits(size: int) -> bool:
        tried.append(size)
        return size <= 300

    assert largest_micro_batch(32, fits, 1024) in range(282, 301)
    assert tried[:5] == [32, 64, 128, 256, 512] and len(tried) <= 10
    assert largest_micro_batch(32, lambda size: size <= 5, 1024) == 5
    assert largest_micro_batch(8, lambda size: False, 64) == 0
    found = split_global_batch(1024, 2, 300)
    assert (found.micro_batch, found.grad_accum_steps) == (256, 2)
    assert split_global_batch(96, 2, 7).micro_batch * split_global_batch(96, 2, 7).grad_accum_steps == 48
