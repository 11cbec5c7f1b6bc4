"""The placement policy every backend shares, with no framework: whether the data sets go
to the device (``data.placement``), the host arrays placing them copies, and the base of a
backend's translator of rows into what it keeps there (:class:`Placing`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic

import numpy as np

from crosstrain.core.data.arrays import Translated
from crosstrain.core.data.batches import ArrayDataset
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.rows import RowKind, Rows, image_rows, translate
from crosstrain.core.data.scaling import ScaledRows
from crosstrain.core.data.sources.images import ImageRows
from crosstrain.core.data.tokens import TokenWindows
from crosstrain.core.errors import PlanError
from crosstrain.core.spec.plan import Plan

#: "auto" places the data when it takes at most this share of the device's free memory
AUTO_SHARE = 0.25


def should_place(
    plan: Plan,
    parts: Iterable[ArrayDataset],
    free_device_bytes: Callable[[], int | None] | None,
    itemsize: Callable[[np.dtype[Any]], int] = lambda dtype: dtype.itemsize,
) -> bool:
    """``data.placement``: "host" never, "device" always, "auto" when the device is an
    accelerator (``free_device_bytes`` given: on a CPU the host already is the device) whose
    free memory is known and holds the arrays in :data:`AUTO_SHARE` of it. ``itemsize``:
    the bytes per value the backend will keep (it may widen a dtype its device lacks)."""
    placement = plan.data.placement
    if placement != "auto":
        return placement == "device"
    parts = list(parts)
    if any(image_rows(part.x) is not None for part in parts):
        return False  # image files are decoded each step, on the host
    free = free_device_bytes() if free_device_bytes is not None else None
    return free is not None and placed_bytes(parts, itemsize) <= AUTO_SHARE * free


def placed_arrays(rows: Rows) -> list[np.ndarray]:
    """The host arrays a data set's ``x`` or ``y`` reads from (what placing copies)."""
    return translate(rows, _PlacedArrays())


def placed_bytes(
    parts: Iterable[ArrayDataset], itemsize: Callable[[np.dtype[Any]], int] = lambda dtype: dtype.itemsize
) -> int:
    """Device bytes the parts would take, an array shared by several parts counted once."""
    arrays = {
        id(array): array for part in parts for rows in (part.x, part.y) for array in placed_arrays(rows)
    }
    return sum(array.size * itemsize(array.dtype) for array in arrays.values())


def unplaceable(rows: object) -> PlanError:
    """The refusal of rows no backend knows how to place."""
    return PlanError(f"cannot place {type(rows).__name__} rows on the device", field="data.placement")


class Placing(Generic[Translated]):
    """The base of a backend's :class:`~crosstrain.core.data.rows.RowsTranslator` into what
    it keeps on its device: it translates arrays, memory-mapped rows, token windows and
    scaled rows; rows read on the host each step (image files, a mixing set's labels,
    shifted windows) are refused here."""

    def images(self, rows: ImageRows) -> Translated:
        raise unplaceable(rows)

    def host(self, rows: RowKind) -> Translated:
        raise unplaceable(rows)


class _PlacedArrays(Placing[list[np.ndarray]]):
    def array(self, rows: np.ndarray) -> list[np.ndarray]:
        return [rows]

    def mapped(self, rows: MappedRows) -> list[np.ndarray]:
        return [rows.array] if rows.index is None else [rows.array, rows.index]

    def windows(self, rows: TokenWindows) -> list[np.ndarray]:
        return [rows.tokens]

    def scaled(self, rows: ScaledRows) -> list[np.ndarray]:
        return translate(rows.raw, self)
