"""Arrays larger than memory on torch: a memory-mapped npy set trains across two workers,
which share one copy of it in the page cache instead of holding one each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli
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
