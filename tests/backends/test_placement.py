"""The placement policy every backend shares: whether ``data.placement`` sends the data sets
to the device, what placing them copies, and the refusal of rows read on the host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.backends.placement import AUTO_SHARE, placed_arrays, placed_bytes, should_place
from crosstrain.core.data.batches import ArrayDataset
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.data.sources.images import ImageRows
from crosstrain.core.data.sources.text import ShiftedWindows
from crosstrain.core.data.tokens import TokenWindows
from crosstrain.core.errors import PlanError
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan

TOKENS = np.arange(400, dtype=np.uint16)
#: a training and an eval set reading one token array: 2 bytes a token
TRAIN = ArrayDataset(TokenWindows(TOKENS, 8, 0, 40, 0, np.int32), TokenWindows(TOKENS, 8, 0, 40, 1, np.int64))
EVAL = ArrayDataset(TokenWindows(TOKENS, 8, 40, 9, 0, np.int32), TokenWindows(TOKENS, 8, 40, 9, 1, np.int64))


def _plan(write_plan: Callable[..., Path], placement: str) -> Plan:
    return load_plan(write_plan(), [f"data.placement='{placement}'"])


def _never_asked() -> int:
    raise AssertionError("the device's free memory was asked for")


def test_host_never_places_and_device_always_does(write_plan: Callable[..., Path]) -> None:
    assert not should_place(_plan(write_plan, "host"), [TRAIN, EVAL], _never_asked)
    assert should_place(_plan(write_plan, "device"), [TRAIN, EVAL], None)


def test_auto_places_what_fits_in_its_share_of_an_accelerator(write_plan: Callable[..., Path]) -> None:
    plan, size = _plan(write_plan, "auto"), TOKENS.nbytes
    assert not should_place(plan, [TRAIN, EVAL], None)  # a CPU: the host is the device
    assert not should_place(plan, [TRAIN, EVAL], lambda: None)  # free memory unknown
    assert should_place(plan, [TRAIN, EVAL], lambda: int(size / AUTO_SHARE))
    assert not should_place(plan, [TRAIN, EVAL], lambda: int(size / AUTO_SHARE) - 1)
    # a backend that widens uint16 tokens to int32 needs twice the room
    assert not should_place(plan, [TRAIN, EVAL], lambda: int(size / AUTO_SHARE), lambda dtype: 4)


def test_auto_keeps_image_files_on_the_host(write_plan: Callable[..., Path]) -> None:
    images = ImageRows(np.asarray(["a.jpg", "b.jpg"]), (8, 8))
    scaled = ArrayDataset(ScaledRows(images, InputScaling(scale=0.5)), np.zeros(2, np.int64))
    assert not should_place(_plan(write_plan, "auto"), [scaled], _never_asked)


def test_placing_copies_every_array_read_once(tmp_path: Path) -> None:
    """An array two parts read is one copy; a view of a file copies the file and its index;
    scaled rows copy their raw rows."""
    assert placed_bytes([TRAIN, EVAL]) == TOKENS.nbytes
    np.save(tmp_path / "x.npy", np.zeros((10, 6), np.uint8))
    file = np.load(tmp_path / "x.npy", mmap_mode="r")
    view = MappedRows(file, (2, 3), np.float32, np.arange(9, 3, -1))
    labels = np.zeros(6, np.int64)
    assert placed_arrays(view) == [file, view.index]
    scaled = ArrayDataset(ScaledRows(view, InputScaling(scale=0.5)), labels)
    assert placed_bytes([scaled]) == file.nbytes + view.index.nbytes + labels.nbytes


@pytest.mark.parametrize(
    "rows",
    [
        ImageRows(np.asarray(["a.jpg"]), (8, 8)),
        ShiftedWindows(TokenWindows(TOKENS, 8, 0, 4, 0, np.int32), np.zeros(4, np.int64)),
    ],
    ids=["images", "shifted windows"],
)
def test_rows_read_on_the_host_are_refused_by_name(rows: object) -> None:
    with pytest.raises(PlanError, match=r"data\.placement: cannot place \w+ rows on the device"):
        placed_arrays(ScaledRows(rows, InputScaling(scale=0.5)))
