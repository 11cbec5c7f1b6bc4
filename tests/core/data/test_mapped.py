"""``source = "npy"``: arrays memory-mapped and read by row index, never loaded whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.errors import PlanError
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan

IMAGE_PLAN = """
name = "npy_images"
[model]
input_shape = [8, 8, 1]
layers = [{ type = "flatten" }, { type = "dense", units = 10 }]
[data]
source = "npy"
x_path = "x.npy"
y_path = "y.npy"
[train]
global_batch_size = 16
"""


def _write(directory: Path, rows: int = 100, y_rows: int | None = None) -> np.ndarray:
    x = np.random.default_rng(0).integers(0, 256, size=(rows, 64), dtype=np.uint8)
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", np.arange(y_rows or rows) % 10)
    return x


def test_rows_are_read_by_index_as_the_model_takes_them(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    x = _write(tmp_path)
    data = load_datasets(load_plan(write_plan(IMAGE_PLAN)))
    assert isinstance(data.train.x, MappedRows) and isinstance(data.train.x.array, np.memmap)
    assert data.train.x.array.dtype == np.uint8  # the file stays as it is until rows are read
    assert (len(data.train), len(data.eval)) == (80, 20)  # type: ignore[arg-type]
    rows = data.train.x[np.array([5, 0])]
    file_rows = data.train.x.file_rows(np.array([5, 0]))
    assert rows.shape == (2, 8, 8, 1) and rows.dtype == np.float32
    assert np.array_equal(rows, x[file_rows].reshape(2, 8, 8, 1).astype(np.float32))
    assert np.array_equal(data.train.y[np.array([5, 0])], file_rows % 10)


def test_an_eval_pair_of_files(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    _write(tmp_path)
    np.save(tmp_path / "ex.npy", np.zeros((7, 8, 8, 1), np.float32))
    np.save(tmp_path / "ey.npy", np.ones(7, np.int64))
    text = IMAGE_PLAN + 'eval_x_path = "ex.npy"\neval_y_path = "ey.npy"\n'
    data = load_datasets(
        load_plan(write_plan(text.replace("[train]", "").replace("global_batch_size = 16", "")))
    )
    assert (len(data.train), len(data.eval)) == (100, 7)  # type: ignore[arg-type]


def test_row_counts_that_differ_name_both_files(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    _write(tmp_path, rows=100, y_rows=99)
    with pytest.raises(PlanError, match=r"data\.y_path: .*x\.npy has 100 rows but .*y\.npy has 99"):
        load_datasets(load_plan(write_plan(IMAGE_PLAN)))


def test_a_missing_file_is_named(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"data\.x_path: no such file .*x\.npy"):
        load_datasets(load_plan(write_plan(IMAGE_PLAN)))
