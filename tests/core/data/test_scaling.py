"""``data.scale``/``mean``/``std``: inputs scaled as read, raw until then."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.batches import Batch
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.rows import stored_rows
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.errors import PlanError
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import SCALED_IMAGES_PLAN, write_images


def test_rows_are_scaled_per_channel_as_read_and_stay_raw_until_then(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    write_images(str(tmp_path))
    plan = load_plan(write_plan(SCALED_IMAGES_PLAN))
    datasets = load_datasets(plan)
    raw_file = np.load(tmp_path / "images.npy")
    for part in (datasets.train, datasets.eval):
        assert part is not None and isinstance(part.x, ScaledRows)
        assert isinstance(part.x.raw, MappedRows) and part.x.raw.array.dtype == np.uint8  # not read yet
    x = datasets.train.x
    assert isinstance(x, ScaledRows) and isinstance(x.raw, MappedRows)
    indices = np.array([5, 0, 5])
    expected = raw_file[x.raw.file_rows(indices)].astype(np.float32)
    expected = (expected * np.float32(1 / 255) - np.float32([0.485, 0.456, 0.406])) / np.float32(
        [0.229, 0.224, 0.225]
    )
    got = x[indices]
    assert got.dtype == np.float32 and got.shape == (3, 8, 8, 3)
    assert np.array_equal(got, expected)


def test_a_batch_hands_its_rows_as_stored_with_the_conversion_that_makes_them_x(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """What a backend copies when the rows stay on the host: the file's uint8 pixels, which
    cast to float32 and scaled are the batch's x, bit for bit."""
    write_images(str(tmp_path))
    plan = load_plan(write_plan(SCALED_IMAGES_PLAN))
    train = load_datasets(plan).train
    batch = Batch.of_rows(train, np.array([7, 2, 7]), np.ones(3, np.float32), np.arange(3))
    stored, dtype, scaling = batch.stored_x()
    assert stored.dtype == np.uint8 and stored.shape == (3, 8, 8, 3)
    assert dtype == np.float32 and scaling == plan.data.scaling
    assert np.array_equal(scaling.apply(stored.astype(dtype)), batch.x)
    assert batch.stored_x()[2] is None  # once x is read on the host, it is handed as it is


def test_stored_rows_of_a_file_read_in_a_wider_dtype_are_the_files(tmp_path: Path) -> None:
    """A memory-mapped file read as float64 (the model's dtype) is stored as float32: its rows
    are read as they are, and cast where the model runs."""
    np.save(tmp_path / "x.npy", np.arange(40, dtype=np.float32).reshape(10, 4) / 3)
    rows = MappedRows(np.load(tmp_path / "x.npy", mmap_mode="r"), (2, 2), np.float64, np.arange(9, -1, -1))
    indices = np.array([1, 8, 1])
    found = stored_rows(rows, indices)
    assert found is not None
    array, file_rows, shape = found
    assert array.dtype == np.float32 and shape == (3, 2, 2)
    assert np.array_equal(array[file_rows].reshape(shape).astype(rows.dtype), rows[indices])
    # the other way round, the host narrows them (fewer bytes to copy): read as x is
    np.save(tmp_path / "wide.npy", np.zeros((10, 4)))
    wide = MappedRows(np.load(tmp_path / "wide.npy", mmap_mode="r"), (4,), np.float32)
    assert stored_rows(wide, indices) is None


def test_identity_steps_are_left_out() -> None:
    assert InputScaling().is_identity and InputScaling().steps() == []
    assert InputScaling(1.0, (0.0,), (1.0,)).is_identity
    assert [name for name, _ in InputScaling(2.0, (), (3.0,)).steps()] == ["mul", "div"]
    x = np.arange(6, dtype=np.uint8)
    assert np.array_equal(InputScaling(0.5, (1.0,)).apply(x), x.astype(np.float32) * 0.5 - 1)


def test_one_value_for_every_channel(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    write_images(str(tmp_path))
    plan = load_plan(write_plan(SCALED_IMAGES_PLAN), ["data.mean=0.5", "data.std=0.25"])
    assert plan.data.mean == (0.5,) and plan.data.std == (0.25,)
    x = load_datasets(plan).train.x
    assert isinstance(x, ScaledRows)
    assert np.array_equal(x[np.arange(2)], (x.raw[np.arange(2)] * np.float32(1 / 255) - 0.5) / 0.25)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.mean=[0.1, 0.2]", "data.mean"),
        ("data.std=[1.0, 0.0, 1.0]", "data.std"),
        ("data.scale=0", "data.scale"),
        ("data.mean='a'", "data.mean"),
    ],
)
def test_bad_scaling_is_refused_naming_the_field(
    write_plan: Callable[..., Path], tmp_path: Path, override: str, field: str
) -> None:
    with pytest.raises(PlanError) as error:
        load_plan(write_plan(SCALED_IMAGES_PLAN), [override])
    assert error.value.field == field, error.value


def test_token_inputs_cannot_be_scaled(write_plan: Callable[..., Path]) -> None:
    from crosstrain.testing.plans import GPT_PLAN

    with pytest.raises(PlanError, match="float inputs") as error:
        load_plan(write_plan(GPT_PLAN), ["data.scale=0.5"])
    assert error.value.field == "data.scale"
