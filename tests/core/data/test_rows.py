"""The rows protocol: every kind of rows answers take, gather, stored and translate alike,
so a backend reads any of them without asking which kind it holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.augment import Augmentation
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.rows import (
    RowKind,
    Rows,
    image_rows,
    input_scaling,
    read_rows,
    stored_rows,
    take_rows,
    translate,
)
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.data.sources.images import ImageRows, MixedTargets
from crosstrain.core.data.sources.text import ShiftedWindows
from crosstrain.core.data.tokens import TokenWindows
from tests.core.image_files import photographs

SCALING = InputScaling(scale=1 / 255, mean=(0.5,), std=(0.25,))
#: rows 3, 0, 3 and the last: repeats and the end
INDICES = np.array([3, 0, 3, 11])


def _file(tmp_path: Path, name: str, array: np.ndarray) -> np.ndarray:
    np.save(tmp_path / name, array)
    mapped: np.ndarray = np.load(tmp_path / name, mmap_mode="r")
    return mapped


def kinds(tmp_path: Path) -> dict[str, Rows]:
    """12 rows of every kind (a view of 12 rows of a larger file too)."""
    rng = np.random.default_rng(0)
    pixels = _file(tmp_path, "pixels.npy", rng.integers(0, 256, (16, 12), dtype=np.uint8))
    wide = _file(tmp_path, "wide.npy", rng.normal(size=(12, 4)))
    tokens = _file(tmp_path, "tokens.npy", rng.integers(0, 50, 200).astype(np.uint16))
    windows = TokenWindows(tokens, length=8, first=2, count=12, offset=1, dtype=np.int64)
    images = ImageRows(photographs(tmp_path, 12), (8, 8), Augmentation(flip=True, mixup=0.4), seed=3)
    return {
        "array": rng.normal(size=(12, 3)).astype(np.float32),
        "mapped view": MappedRows(pixels, (3, 4), np.float32, np.arange(15, 3, -1)),
        "mapped, read narrower": MappedRows(wide, (4,), np.float32),
        "token windows": windows,
        "shifted windows": ShiftedWindows(windows, np.arange(12) % 3),
        "scaled array": ScaledRows(rng.integers(0, 256, (12, 2, 3)).astype(np.uint8), SCALING),
        "scaled mapped view": ScaledRows(MappedRows(pixels, (4, 3), np.uint8, np.arange(12)), SCALING),
        "images": images,
        "scaled images": ScaledRows(images, SCALING),
        "mixed labels": MixedTargets(np.arange(12) % 5, images),
    }


#: the translator method each kind calls
KIND_METHODS = {
    "array": "array",
    "mapped view": "mapped",
    "mapped, read narrower": "mapped",
    "token windows": "windows",
    "shifted windows": "host",
    "scaled array": "scaled",
    "scaled mapped view": "scaled",
    "images": "images",
    "scaled images": "scaled",
    "mixed labels": "host",
}


class _MethodNames:
    """A translator that answers with the name of the method the rows called."""

    def array(self, rows: np.ndarray) -> str:
        return "array"

    def mapped(self, rows: MappedRows) -> str:
        return "mapped"

    def windows(self, rows: TokenWindows) -> str:
        return "windows"

    def scaled(self, rows: ScaledRows) -> str:
        return "scaled"

    def images(self, rows: ImageRows) -> str:
        return "images"

    def host(self, rows: RowKind) -> str:
        return "host"


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rows]:
    return kinds(tmp_path_factory.mktemp("rows"))


@pytest.mark.parametrize("name", list(KIND_METHODS))
def test_each_kind_calls_its_own_translator_method(every_kind: dict[str, Rows], name: str) -> None:
    assert translate(every_kind[name], _MethodNames()) == KIND_METHODS[name]


@pytest.mark.parametrize("name", list(KIND_METHODS))
def test_rows_taken_read_as_the_rows_they_were_taken_from(every_kind: dict[str, Rows], name: str) -> None:
    rows = every_kind[name]
    expected = read_rows(rows, INDICES)
    taken = take_rows(rows, INDICES)
    assert len(taken) == len(INDICES)
    read = read_rows(taken, np.arange(len(INDICES)))
    assert read.dtype == expected.dtype == rows.dtype and np.array_equal(read, expected)
    assert np.array_equal(np.asarray(rows[INDICES]), expected)  # indexing reads them too


@pytest.mark.parametrize("name", list(KIND_METHODS))
def test_stored_rows_cast_and_scaled_are_the_rows(every_kind: dict[str, Rows], name: str) -> None:
    """Where a backend copies rows from before converting them where the model runs: the
    file's uint8 stay uint8, images are decoded as uint8 (in the epoch asked), and rows that
    are more than a gather (windows, mixed labels) or stored wider than read have none."""
    rows = every_kind[name]
    found = stored_rows(rows, INDICES, epoch=2)
    if name in ("token windows", "shifted windows", "mixed labels", "mapped, read narrower"):
        assert found is None
        return
    assert found is not None
    array, indices, shape = found
    stored = np.asarray(array[indices]).reshape(shape)
    scaling = input_scaling(rows)
    converted = stored.astype(rows.dtype) if scaling is None else scaling.apply(stored)
    assert np.array_equal(converted, read_rows(rows, INDICES, epoch=2))
    assert stored.dtype == (np.float32 if name == "array" else np.uint8)


def test_only_scaled_rows_scale_and_only_images_decode(every_kind: dict[str, Rows]) -> None:
    scaled = [name for name, rows in every_kind.items() if input_scaling(rows) is not None]
    assert scaled == ["scaled array", "scaled mapped view", "scaled images"]
    assert image_rows(every_kind["scaled images"]) is image_rows(every_kind["images"]) is every_kind["images"]
    assert [name for name, rows in every_kind.items() if image_rows(rows) is not None] == [
        "images",
        "scaled images",
    ]


def test_a_view_of_a_file_stays_unread(every_kind: dict[str, Rows]) -> None:
    rows = every_kind["scaled mapped view"]
    taken = take_rows(rows, INDICES)
    assert isinstance(taken, ScaledRows) and isinstance(taken.raw, MappedRows)
    assert isinstance(take_rows(every_kind["images"], INDICES), ImageRows)  # not decoded
