"""Checkpoints, resume, stop requests and non-finite losses, through the loop, against a
numpy backend (:class:`crosstrain.testing.null.MomentumStrategy`) whose state (a weight, a
momentum slot, a step count) depends on every batch it saw and in which order: a resumed
run equals an uninterrupted one only if the weights, the slot, the count and the
sampler's position all come back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crosstrain.core.checkpoint import (
    complete_checkpoints,
    last_checkpoint,
    read_checkpoint,
)
from crosstrain.core.errors import BackendError, CheckpointError
from crosstrain.core.loop import train
from crosstrain.core.planfile import load_plan
from crosstrain.core.resume import check_backend_supports
from crosstrain.core.strategy import Job
from crosstrain.testing.null import MomentumStrategy
from tests.support import StepRecorder

SETTINGS = [
    "train.epochs=2",
    "train.max_steps=60",  # 45 steps an epoch: the run crosses into the second
    "output.checkpoint_every_steps=20",
    "output.log_every_steps=5",
    "optimizer.name='sgd'",
    "schedule.name='cosine'",
]


def _job(write_plan: Callable[..., Path], out: Path, *settings: str, resume: bool = False) -> Job:
    plan = load_plan(write_plan(), [*SETTINGS, *settings])
    return Job(plan=plan, backend="numpy", out_dir=str(out), resume=resume)


def _run(
    strategy: MomentumStrategy, job: Job, recorder: StepRecorder | None = None
) -> tuple[Any, Any, StepRecorder]:
    recorder = recorder or StepRecorder()
    summary, state = train(strategy, job, recorder)  # type: ignore[arg-type]
    return summary, state, recorder


def test_a_resumed_run_equals_an_uninterrupted_one(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    whole, whole_state, whole_steps = _run(MomentumStrategy(), _job(write_plan, tmp_path / "whole"))
    broken = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="failed at step 45"):
        _run(MomentumStrategy(fail_at=45), _job(write_plan, broken))
    assert [step for step, _ in complete_checkpoints(broken)] == [20, 40]
    resumed, state, steps = _run(MomentumStrategy(), _job(write_plan, broken, resume=True))
    assert steps.steps == whole_steps.steps[40:]  # steps 41-60, mid-epoch on, bit for bit
    assert np.array_equal(state["w"], whole_state["w"]) and state["steps"] == whole_state["steps"] == 60
    assert resumed["train"] == whole["train"] and resumed["eval"] == whole["eval"]
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == 60


def test_checkpoint_folders_hold_the_loop_state_and_are_pruned(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    _run(MomentumStrategy(), _job(write_plan, tmp_path, "output.keep_checkpoints=2"))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [40, 60]  # 20 pruned; 60: the end
    saved = read_checkpoint(tmp_path / "checkpoints" / "step-00000040")
    assert (saved.state.step, saved.state.epoch, saved.state.step_in_epoch) == (40, 0, 40)
    assert saved.optimizer["optimizer.step"] == 40 and "optimizer.w.momentum" in saved.optimizer
    assert saved.state.backend == "numpy" and len(saved.state.plan_hash) == 16
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporaries


def test_a_torn_checkpoint_is_not_resumed_from(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        _run(MomentumStrategy(fail_at=45), _job(write_plan, tmp_path))
    torn = tmp_path / "checkpoints" / ".step-00000044.tmp"  # a crash mid-write leaves this
    torn.mkdir()
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000040"


def test_resuming_another_plan_is_refused(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    _run(MomentumStrategy(), _job(write_plan, tmp_path))
    with pytest.raises(CheckpointError, match="written by another plan"):
        _run(MomentumStrategy(), _job(write_plan, tmp_path, "optimizer.lr=0.5", resume=True))


def test_keep_best_keeps_the_best_evaluation(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    settings = (
        "train.epochs=4",
        "train.max_steps=180",
        "output.keep_checkpoints=1",
        "output.keep_best='eval.loss'",
    )
    _run(MomentumStrategy(), _job(write_plan, tmp_path, *settings))
    kept = complete_checkpoints(tmp_path)
    evals = [json.loads(p.read_text()) for p in [path / "state.json" for _, path in kept]]
    assert len(kept) == 2 and kept[-1][0] == 180
    best = min(evals, key=lambda state: state["eval"]["loss"])
    assert best["eval_step"] == best["step"]  # evaluated at its own step


def test_a_plugin_stops_the_run_normally(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    summary, _, recorder = _run(MomentumStrategy(), _job(write_plan, tmp_path), StepRecorder(stop_at=12))
    # asked at step 12 (read in the chunk of steps 11-15): the ranks agree after that chunk
    assert summary["stopped"] == {"kind": "requested", "reason": "enough", "step": 15}
    assert summary["steps"] == 15 and recorder.steps[-1][0] == 15
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [15]  # the end checkpoint


def test_a_non_finite_loss_stops_at_its_step(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    summary, _, recorder = _run(MomentumStrategy(nan_at=27), _job(write_plan, tmp_path))
    assert summary["stopped"]["kind"] == "nonfinite" and summary["stopped"]["step"] == 27
    assert "non-finite loss (nan) at step 27" in summary["stopped"]["reason"]
    assert recorder.steps[-1][0] == 27  # steps 28-30 ran in its chunk but are not logged
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [20]  # the last good one
    assert not (tmp_path / "model.safetensors").exists()  # no NaN model saved


def test_what_a_backend_cannot_do_is_refused_before_launch(
    write_plan: Callable[..., Path],
) -> None:
    class NoOptimizerState:
        name = "bare"

    plan = load_plan(write_plan(), ["output.checkpoint_every_steps=10"])
    with pytest.raises(BackendError, match=r"output\.checkpoint_every_steps: the bare backend cannot save"):
        check_backend_supports(NoOptimizerState(), plan, "bare")  # type: ignore[arg-type]
    skip = load_plan(write_plan(), ["train.on_nonfinite='skip'"])
    with pytest.raises(BackendError, match=r"train\.on_nonfinite = 'skip': the bare backend cannot skip"):
        check_backend_supports(NoOptimizerState(), skip, "bare")  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="--max-restarts: the bare backend cannot restart"):
        check_backend_supports(NoOptimizerState(), load_plan(write_plan()), "bare", 1)  # type: ignore[arg-type]
    placed = load_plan(write_plan(), ["data.placement='device'"])
    with pytest.raises(BackendError, match=r"data\.placement = 'device': the bare backend keeps the data"):
        check_backend_supports(NoOptimizerState(), placed, "bare")  # type: ignore[arg-type]
    check_backend_supports(NoOptimizerState(), load_plan(write_plan(), ["data.placement='host'"]), "bare")  # type: ignore[arg-type]
