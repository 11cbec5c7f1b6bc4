"""The torch backend on real gloo processes: world N trains as world 1 (crosstrain's batches,
the loss normalised by the global count of real rows), end to end."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.api import LaunchOptions, make_job, prepare_plan
from tests.conftest import EXAMPLES, run_cli
from tests.support import assert_same_eval, max_relative_difference, step_losses, summary
from tests.torch.workers import eval_per_rank, weights_per_rank

pytestmark = pytest.mark.torch


def _run(plan: Path, out: Path, nproc: int, *overrides: str) -> Path:
    args = [
        "run",
        str(plan),
        "--backend",
        "torch",
        "--nproc",
        str(nproc),
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    for override in overrides:
        args += ["--set", override]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    return out


def test_parameters_are_bitwise_identical_across_ranks(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    plan = prepare_plan(write_plan(), ["train.max_steps=20", "optimizer.name='adam'", "optimizer.lr=0.01"])
    job = make_job(plan, LaunchOptions(replicas=2, device="cpu", out=tmp_path / "run"))
    weights = weights_per_rank(job)
    assert set(weights) == {0, 1}
    for name, value in weights[0].items():
        assert np.array_equal(value, weights[1][name]), name


def test_world_1_and_world_2_give_the_same_losses(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    plan = write_plan()
    one = _run(plan, tmp_path / "one", 1, "train.max_steps=30")
    two = _run(plan, tmp_path / "two", 2, "train.max_steps=30")
    losses_one, losses_two = step_losses(one), step_losses(two)
    assert len(losses_one) == 30
    assert max_relative_difference(losses_two, losses_one) <= 1e-5
    assert summary(two)["world_size"] == 2


def test_eval_at_world_2_equals_world_1(
    write_plan: Callable[..., Path], tmp_path: Path, odd_npz: Path
) -> None:
    plan = prepare_plan(
        write_plan(), ["data.source='npz'", f"data.path='{odd_npz}'", "train.global_batch_size=16"]
    )
    one = eval_per_rank(make_job(plan, LaunchOptions(replicas=1, device="cpu", out=tmp_path / "one")))
    two = eval_per_rank(make_job(plan, LaunchOptions(replicas=2, device="cpu", out=tmp_path / "two")))
    assert one[0]["count"] == 41  # 203 rows x 0.2: not a multiple of the batch of 16
    assert two[0] == two[1]  # one all-reduced result, the same bits on every rank
    # counts and hits exactly; the loss within fp32 rounding of rows in batches of 8 vs 16
    assert_same_eval(two[0], one[0])


def test_eval_through_the_cli_counts_every_row_once(
    write_plan: Callable[..., Path], tmp_path: Path, odd_npz: Path
) -> None:
    data = ["data.source='npz'", f"data.path='{odd_npz}'", "train.global_batch_size=16", "train.max_steps=3"]
    result = summary(_run(write_plan(), tmp_path / "two", 2, *data))
    assert result["eval"]["count"] == 41


def test_grad_accumulation_matches_one_big_batch(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    plan = write_plan()
    plain = _run(plan, tmp_path / "plain", 2, "train.max_steps=20")
    accumulated = _run(plan, tmp_path / "accum", 2, "train.max_steps=20", "train.grad_accum_steps=2")
    assert max_relative_difference(step_losses(accumulated), step_losses(plain)) <= 1e-5


def test_a_failing_rank_ends_the_run_with_its_traceback_once(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    started = time.monotonic()
    result = run_cli(
        "-p",
        "tests.failing_plugin",
        "run",
        str(write_plan()),
        "--backend",
        "torch",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed < 30
    assert result.stderr.count("Traceback (most recent call last)") == 1
    assert result.stderr.rstrip().endswith(
        "crosstrain: error: rank 1 failed: RuntimeError: injected failure at step 3"
    )
    # what was written before the failure is kept
    assert len(step_losses(tmp_path / "run")) >= 2


def test_digits_example_reaches_95_percent(tmp_path: Path) -> None:
    run = _run(EXAMPLES / "digits_mlp.toml", tmp_path / "digits", 2)
    result = summary(run)
    assert result["eval"]["accuracy"] >= 0.95
    assert result["backend"] == "torch" and result["world_size"] == 2
    for key in ("steps", "samples_per_second", "wall_seconds"):
        assert result[key] > 0
    assert (run / "model.safetensors").is_file()
