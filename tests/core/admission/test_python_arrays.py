"""crosstrain.fit(plan, x=..., y=..., eval=...): arrays held in Python train exactly as the
same rows read from a file, through the run folder's own .npy files; a bad array is refused
in one line before anything is written. On the momentum backend (crosstrain.testing.null),
whose state depends on every row it saw and in which order, in pytest's process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crosstrain
from crosstrain.core.errors import InputError, RunFolderError
from crosstrain.core.run.job import PluginSelection
from crosstrain.testing import step_losses, summary

NULL = PluginSelection(enabled=("crosstrain.testing.null",))
SETTINGS = ["train.epochs=2", "output.log_every_steps=1"]


@pytest.fixture
def rows() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "x": rng.normal(size=(150, 64)).astype(np.float32),
        "y": rng.integers(0, 10, size=150),
        "x_eval": rng.normal(size=(40, 64)).astype(np.float32),
        "y_eval": rng.integers(0, 10, size=40),
    }


def fit(plan: Path | None, out: Path, **keywords: Any) -> dict[str, Any]:
    keywords.setdefault("overrides", SETTINGS)
    return crosstrain.fit(plan, "momentum", plugins=NULL, out=out, **keywords)


def test_arrays_train_as_the_same_rows_read_from_a_file(
    write_plan: Callable[..., Path], rows: dict[str, np.ndarray], tmp_path: Path
) -> None:
    plan = write_plan()
    np.savez(tmp_path / "rows.npz", **rows)
    from_file = [
        *SETTINGS,
        "data.source='npz'",
        f"data.path='{tmp_path / 'rows.npz'}'",
        "data.eval_x_key='x_eval'",
        "data.eval_y_key='y_eval'",
    ]
    fit(plan, tmp_path / "file", overrides=from_file)
    fit(plan, tmp_path / "arrays", x=rows["x"], y=rows["y"], eval=(rows["x_eval"], rows["y_eval"]))
    assert list(step_losses(tmp_path / "arrays")) == list(step_losses(tmp_path / "file"))
    assert summary(tmp_path / "arrays")["eval"] == summary(tmp_path / "file")["eval"]
    # the run folder holds the rows and reads them as any .npy plan does
    data = json.loads((tmp_path / "arrays" / "plan.json").read_text())["plan"]["data"]
    assert data["source"] == "npy"
    assert Path(data["x_path"]) == (tmp_path / "arrays" / "arrays" / "x.npy").resolve()
    assert np.array_equal(np.load(data["eval_y_path"]), rows["y_eval"])


def test_the_run_folder_alone_continues_the_run(
    write_plan: Callable[..., Path], rows: dict[str, np.ndarray], tmp_path: Path
) -> None:
    checkpointed = [*SETTINGS, "output.checkpoint_every_steps=5"]
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    fit(write_plan(), whole, x=rows["x"], y=rows["y"], overrides=checkpointed)
    fit(write_plan(), parted, x=rows["x"], y=rows["y"], overrides=[*checkpointed, "train.max_steps=5"])
    fit(None, parted, resume=True, overrides=["train.max_steps=8"])
    assert summary(parted)["steps"] == 8
    assert list(step_losses(parted)) == list(step_losses(whole))[:8]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: {**r, "x": r["x"][:, :63]}, "fit: x has rows of shape [63], which does not fit"),
        (
            lambda r: {**r, "y": r["y"] + 1},
            "fit: y: labels span 0..10 but the model's last layer has 10 units",
        ),
        (lambda r: {**r, "x": np.where(r["x"] > 2, np.nan, r["x"])}, "fit: x holds NaN or infinite values"),
        (lambda r: {**r, "y": r["y"][:-1]}, "fit: y has 149 rows but x has 150"),
        (
            lambda r: {**r, "y_eval": r["y_eval"] * 0.5},
            "fit: eval y: cross_entropy needs integer class labels",
        ),
        (lambda r: {**r, "x": [["a"]]}, "fit: x is no array of numbers"),
    ],
)
def test_a_bad_array_is_refused_before_anything_is_written(
    write_plan: Callable[..., Path],
    rows: dict[str, np.ndarray],
    tmp_path: Path,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    message: str,
) -> None:
    bad = change(rows)
    with pytest.raises(InputError) as refused:
        fit(write_plan(), tmp_path / "run", x=bad["x"], y=bad["y"], eval=(bad["x_eval"], bad["y_eval"]))
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_a_folder_holding_a_run_is_refused_before_the_arrays_are_written(
    write_plan: Callable[..., Path], rows: dict[str, np.ndarray], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    fit(write_plan(), out, x=rows["x"], y=rows["y"])
    written = (out / "arrays" / "x.npy").stat().st_mtime_ns
    with pytest.raises(RunFolderError, match="already holds a run"):
        fit(write_plan(), out, x=rows["x"][:100], y=rows["y"][:100])
    assert (out / "arrays" / "x.npy").stat().st_mtime_ns == written
    with pytest.raises(InputError, match="resume=True continues on the arrays its run folder holds"):
        fit(None, out, x=rows["x"], y=rows["y"], resume=True)
