"""--max-restarts: a worker that dies restarts the whole group (torch's elastic agent), which
resumes from the run folder's last checkpoint; the run ends as if nothing happened."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.testing.conformance import FAIL_STEP, RESUME_SETTINGS, STEPS, run_cli, train, write_plan
from tests.support import step_losses, summary

pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def test_a_dead_worker_restarts_the_group_from_the_last_checkpoint(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, "dropout_mlp")
    uninterrupted = train("torch", plan, tmp_path / "whole", 2)
    once = tmp_path / "failed-once"
    result = run_cli(
        "-p", "no:progress", "-p", "crosstrain.testing.faults", "run", str(plan), "--nproc", "2",
        "--device", "cpu", "--out", str(tmp_path / "run"), "--set", f"train.max_steps={STEPS}",
        *RESUME_SETTINGS, "--max-restarts", "1",
        env={"CROSSTRAIN_TEST_FAIL_STEP": str(FAIL_STEP), "CROSSTRAIN_TEST_FAIL_ONCE": str(once)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert once.exists()  # a worker did die
    assert np.array_equal(step_losses(tmp_path / "run"), step_losses(uninterrupted))
    assert summary(tmp_path / "run")["eval"] == summary(uninterrupted)["eval"]
    assert summary(tmp_path / "run")["resumed_from_step"] == 5
