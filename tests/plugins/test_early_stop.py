"""The built-in early_stop plugin, through the loop (a numpy backend): it asks to stop when
the monitored eval metric has not improved for `patience` evaluations, the run ends
normally, and --restore-best ends with the best checkpoint's weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pluggy
import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.run.job import Job, LaunchOptions, Layout
from crosstrain.core.run.loop import train
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins import early_stop, hookspecs
from crosstrain.testing.null import MomentumStrategy

SETTINGS = [
    "train.epochs=12",
    "output.checkpoint_every_steps=1000",
    "output.keep_best='eval.loss'",
    "output.keep_checkpoints=1",
    "optimizer.lr=0.5",  # MomentumStrategy's eval loss is w^2: it falls, then overshoots and rises
]


def _hook() -> pluggy.HookRelay:
    manager = pluggy.PluginManager("crosstrain")
    manager.add_hookspecs(hookspecs)
    manager.register(early_stop)
    return manager.hook


def _train(write_plan: Callable[..., Path], out: Path, **options: Any) -> tuple[dict[str, Any], Any]:
    plan = load_plan(write_plan(), SETTINGS)
    job = Job(plan=plan, layout=Layout("numpy", 1), launch=LaunchOptions(options=options), out_dir=str(out))
    return train(MomentumStrategy(), job, _hook())  # type: ignore[arg-type]


def test_stops_when_the_metric_stops_improving(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    whole, _ = _train(write_plan, tmp_path / "whole")
    stopped, _ = _train(write_plan, tmp_path / "stopped", early_stop="eval.loss", patience=2, min_delta=0.0)
    assert whole["stopped"] is None and whole["epochs"] == 12
    assert (
        stopped["stopped"]["kind"] == "requested"
        and "early stopping: eval.loss" in stopped["stopped"]["reason"]
    )
    assert stopped["steps"] < whole["steps"] and stopped["steps"] % 45 == 0  # at an epoch's end


def test_restore_best_ends_with_the_best_weights(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    options = {"early_stop": "eval.loss", "patience": 2, "min_delta": 0.0, "restore_best": True}
    summary, state = _train(write_plan, tmp_path, **options)
    best = summary["stopped"]["restored_step"]
    assert best < summary["steps"] and summary["eval"]["loss"] == pytest.approx(
        float((state["w"] ** 2).sum())
    )
    assert np.isfinite(state["w"]).all()


def test_restore_best_needs_keep_best_of_the_same_metric(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    with pytest.raises(PlanError, match=r"--restore-best needs output\.keep_best = 'eval\.accuracy'"):
        _train(write_plan, tmp_path, early_stop="eval.accuracy", restore_best=True)
