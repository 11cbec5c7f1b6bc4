"""Real runs of the jax backend through crosstrain's API and CLI: crosstrain's batches and the
global loss normalisation hold when the replicas are devices of one process, and failures
end the run cleanly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import crosstrain
import numpy as np

from jaxtest_support import (
    CNN_PLAN,
    EXAMPLES,
    max_relative_difference,
    run_cli,
    step_losses,
    summary,
)


def _fit(plan: Path, out: Path, nproc: int, *overrides: str) -> Path:
    crosstrain.fit(plan, backend="jax", nproc=nproc, device="cpu", out=out, overrides=overrides)
    return out


def test_world_1_and_world_2_give_the_same_losses(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    plan = write_plan()
    one = _fit(plan, tmp_path / "one", 1, "train.max_steps=30")
    two = _fit(plan, tmp_path / "two", 2, "train.max_steps=30")
    losses_one, losses_two = step_losses(one), step_losses(two)
    assert len(losses_one) == 30
    assert max_relative_difference(losses_two, losses_one) <= 1e-5
    assert summary(two)["world_size"] == 2 and summary(two)["processes"] == 1


def test_every_image_layer_type_trains_alike_on_1_and_2_devices(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    # batch norm's statistics are over the global micro-batch and dropout's masks hash each
    # row's global position, so sharding the batch over two devices changes neither
    plan = write_plan(CNN_PLAN)
    one, two = _fit(plan, tmp_path / "one", 1), _fit(plan, tmp_path / "two", 2)
    losses_one, losses_two = step_losses(one), step_losses(two)
    assert len(losses_one) == 8  # 240 training rows: the last step is half padding
    assert np.all(np.isfinite(losses_one))
    assert max_relative_difference(losses_two, losses_one) <= 1e-5


def test_a_token_model_trains_alike_on_1_and_2_devices(token_plan: Path, tmp_path: Path) -> None:
    one, two = _fit(token_plan, tmp_path / "one", 1), _fit(token_plan, tmp_path / "two", 2)
    losses_one, losses_two = step_losses(one), step_losses(two)
    assert len(losses_one) == 12
    assert max_relative_difference(losses_two, losses_one) <= 1e-5
    # the loss is per target token: it starts near log(32) and the pattern is learnt
    assert abs(losses_one[0] - np.log(32)) < 0.5 and losses_one[-1] < losses_one[0] - 1
    # evaluation counts target positions: 80 eval windows (20 % of 399) x 16 tokens
    assert summary(one)["eval"]["count"] == summary(two)["eval"]["count"] == 80 * 16


def test_grad_accumulation_matches_one_big_batch(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    plan = write_plan()
    plain = _fit(plan, tmp_path / "plain", 2, "train.max_steps=20")
    accumulated = _fit(plan, tmp_path / "accum", 2, "train.max_steps=20",
                       "train.grad_accum_steps=2")
    assert max_relative_difference(step_losses(accumulated), step_losses(plain)) <= 1e-5


def test_eval_through_the_cli_counts_every_row_once(
    write_plan: Callable[..., Path], tmp_path: Path, odd_npz: Path
) -> None:
    result = run_cli("run", str(write_plan()), "--backend", "jax", "--nproc", "2",
                     "--device", "cpu", "--out", str(tmp_path / "run"),
                     "--set", "data.source='npz'", "--set", f"data.path='{odd_npz}'",
                     "--set", "train.global_batch_size=16", "--set", "train.max_steps=3")
    assert result.returncode == 0, result.stderr
    assert summary(tmp_path / "run")["eval"]["count"] == 41  # 203 rows x 0.2, batches of 16


def test_digits_example_reaches_95_percent(tmp_path: Path) -> None:
    run = tmp_path / "digits"
    result = run_cli("run", str(EXAMPLES / "digits_mlp.toml"), "--backend", "jax", "--nproc", "2",
                     "--device", "cpu", "--out", str(run))
    assert result.returncode == 0, result.stderr
    assert "digits_mlp on jax x2" in result.stdout
    outcome = summary(run)
    assert outcome["eval"]["accuracy"] >= 0.95
    assert outcome["backend"] == "jax" and outcome["world_size"] == 2 and outcome["device"] == "cpu"
    assert (run / "model.safetensors").is_file()
