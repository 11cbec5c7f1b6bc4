"""The torch backend on real gloo processes: world N trains as world 1 (crosstrain's batches,
the loss normalised by the global count of real rows), end to end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.api import LaunchOptions, make_job, prepare_plan
from tests.support import assert_same_eval
from tests.torch.workers import eval_per_rank, weights_per_rank

pytestmark = pytest.mark.torch


def test_parameters_are_bitwise_identical_across_ranks(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    plan = prepare_plan(write_plan(), ["train.max_steps=20", "optimizer.name='adam'", "optimizer.lr=0.01"])
    job = make_job(plan, LaunchOptions(replicas=2, device="cpu", out=tmp_path / "run"))
    weights = weights_per_rank(job)
    assert set(weights) == {0, 1}
    for name, value in weights[0].items():
        assert np.array_equal(value, weights[1][name]), name


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
