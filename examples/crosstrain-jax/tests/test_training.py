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
    max_relative_difference,
    step_losses,
    summary,
)


def _fit(plan: Path, out: Path, nproc: int, *overrides: str) -> Path:
    crosstrain.fit(plan, backend="jax", nproc=nproc, device="cpu", out=out, overrides=overrides)
    return out


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
