"""Arrays larger than memory on torch: a memory-mapped npy set trains across two workers,
which share one copy of it in the page cache instead of holding one each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import MLP_PLAN, run_cli
from tests.support import step_losses, summary

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

ROWS, SIDE = 32768, 64  # 128 MiB of uint8 images: far more than a few batches in float32

PLAN = f"""
name = "npy_images"
[model]
input_shape = [{SIDE}, {SIDE}, 1]
layers = [{{ type = "avgpool2d", pool_size = 8 }}, {{ type = "flatten" }}, {{ type = "dense", units = 10 }}]
[data]
source = "npy"
x_path = "x.npy"
y_path = "y.npy"
placement = "host"
[optimizer]
name = "sgd"
lr = 0.000001
[train]
global_batch_size = 512
epochs = 1
"""


def test_two_workers_train_on_one_shared_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.integers(0, 256, size=(ROWS, SIDE, SIDE, 1), dtype=np.uint8))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, size=ROWS))
    (tmp_path / "plan.toml").write_text(PLAN)
    out = tmp_path / "run"
    result = run_cli(
        "-p", "tests.memory_plugin", "-p", "no:progress", "run", str(tmp_path / "plan.toml"),
        "--nproc", "2", "--device", "cpu", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(step_losses(out)) == 52 and summary(out)["eval"]["count"] == round(ROWS * 0.2)
    size = (tmp_path / "x.npy").stat().st_size
    for rank in (0, 1):
        memory = json.loads((out / f"memory-rank{rank}.json").read_text())
        # each worker read (nearly) every page through its mapping of the file: the page
        # cache's one copy, shared; its private memory did not grow by anything like a copy
        assert memory["npy_resident"] > 0.75 * size, (rank, memory, size)
        assert memory["anonymous_grown"] < 0.5 * size, (rank, memory, size)


def test_torch_tensors_handed_to_fit_train_as_the_same_rows_read_from_a_file(tmp_path: Path) -> None:
    """crosstrain.fit(plan, x=, y=, eval=) with torch tensors: the rows are copied to the
    host once, written into the run folder and memory-mapped by both workers."""
    import torch

    import crosstrain

    rng = np.random.default_rng(5)
    rows = {"x": rng.normal(size=(300, 64)).astype(np.float32), "y": rng.integers(0, 10, size=300)}
    rows |= {"x_eval": rows["x"][:60] * 0.5, "y_eval": rows["y"][:60]}
    np.savez(tmp_path / "rows.npz", **rows)
    plan = tmp_path / "plan.toml"
    plan.write_text(MLP_PLAN)
    settings = ["train.epochs=2", "output.log_every_steps=1"]
    from_file = ["data.source='npz'", f"data.path='{tmp_path / 'rows.npz'}'"]
    from_file += ["data.eval_x_key='x_eval'", "data.eval_y_key='y_eval'"]
    quiet = crosstrain.PluginSelection(disabled=("progress",))
    launch = {"backend": "torch", "nproc": 2, "device": "cpu", "plugins": quiet}
    crosstrain.fit(plan, out=tmp_path / "file", overrides=[*settings, *from_file], **launch)
    tensors = {name: torch.from_numpy(array) for name, array in rows.items()}
    crosstrain.fit(
        plan,
        out=tmp_path / "tensors",
        overrides=settings,
        x=tensors["x"],
        y=tensors["y"],
        eval=(tensors["x_eval"], tensors["y_eval"]),
        **launch,
    )
    assert np.max(np.abs(step_losses(tmp_path / "tensors") - step_losses(tmp_path / "file"))) <= 1e-7
    assert summary(tmp_path / "tensors")["eval"] == summary(tmp_path / "file")["eval"]
