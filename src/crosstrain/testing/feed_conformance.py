"""A backend's feed checked in process against core's rows protocol
(:mod:`crosstrain.core.data.rows`): subclass :class:`FeedConformance` in the backend's tests.

Every kind of rows (arrays, token windows, memory-mapped rows, scaled rows, images...) reaches
the model as core reads it, placed on the device or kept on the host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import attrs
import numpy as np
import pytest

from crosstrain.core.data.batches import ArrayDataset, Batch, Datasets
from crosstrain.core.data.rows import read_rows
from crosstrain.core.run.loading import epoch_rows, load_datasets
from crosstrain.core.run.strategy import PlacesData
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins.manager import get_backend, make_plugin_manager
from crosstrain.testing.launches import (
    write_plan,
)

#: the plans whose rows the feed checks read, with their settings, by the kinds of rows
#: they make: arrays; arrays scaled (a table's standardized columns); token windows, and
#: with each epoch's window offsets shifted windows; a memory-mapped file's uint8 rows
#: scaled, each part a view of the file; image files decoded, augmented and mixed, and
#: their mixed labels
FEED_PLANS: dict[str, tuple[str, ...]] = {
    "dropout_mlp": (),
    "table": (),
    "gpt": ("data.augment.window_offset=true",),
    "scaled_images": (),
    "image_folder": (),
}
#: plans whose rows are read on the host each step, whatever the placement asks
HOST_READ_PLANS = ("image_folder",)


@attrs.frozen
class FeedUnderTest:
    """A backend's feed given a plan's data sets: whether it placed them on the device, and a
    batch's x and y as its model receives them (as numpy arrays)."""

    placed: bool
    rows: Callable[[Batch], tuple[np.ndarray, np.ndarray]]


class FeedConformance:
    """A backend's feed against core's rows protocol (:mod:`crosstrain.core.data.rows`):
    every kind of rows a plan makes reaches the model in the dtype and with the values of
    core's reference read (:func:`~crosstrain.core.data.rows.read_rows`), whether the data
    sets are placed on the device or kept on the host. Subclass it in the backend's tests,
    name the backend and implement :meth:`feed`."""

    backend: ClassVar[str]

    def feed(self, plan: Plan, datasets: Datasets) -> FeedUnderTest:
        """The backend's feed with ``datasets`` handed to it as a run hands them over. This
        one is a backend's without :class:`PlacesData`, whose model reads ``batch.x`` and
        ``batch.y``: core's own read."""
        return FeedUnderTest(False, lambda batch: (batch.x, batch.y))

    @pytest.mark.parametrize("placement", ["device", "host"])
    @pytest.mark.parametrize("name", list(FEED_PLANS))
    def test_feed_gives_every_kind_of_rows_as_core_reads_them(
        self, name: str, placement: str, tmp_path: Path
    ) -> None:
        """Rows 3, 0, 3 and the last of each part, training rows read in an epoch (images
        augmented, labels mixed, windows shifted) and eval rows without one. Rows read on
        the host each step are never placed: their plans ask for "auto" instead."""
        host_read = name in HOST_READ_PLANS
        asked = "auto" if host_read and placement == "device" else placement
        plan = load_plan(write_plan(tmp_path, name), [*FEED_PLANS[name], f"data.placement='{asked}'"])
        datasets = load_datasets(plan)
        fed = self.feed(plan, datasets)
        places_data = isinstance(get_backend(make_plugin_manager(), self.backend)(), PlacesData)
        assert fed.placed == (placement == "device" and not host_read and places_data)
        for part, epoch in _parts_as_read(plan, datasets):
            indices = np.array([3, 0, 3, len(part) - 1])
            batch = Batch.of_rows(part, indices, np.ones(4, np.float32), np.arange(4), epoch)
            for got, rows in zip(fed.rows(batch), (part.x, part.y), strict=True):
                expected = read_rows(rows, indices, epoch)
                assert got.dtype == expected.dtype, (type(rows).__name__, got.dtype, expected.dtype)
                assert np.array_equal(got, expected), type(rows).__name__


def _parts_as_read(plan: Plan, datasets: Datasets) -> list[tuple[ArrayDataset, int | None]]:
    """Each part of the data sets with the epoch a run reads it in: the training rows in
    epoch 1 (as that epoch moves them, when it does), the eval rows in none."""
    parts: list[tuple[ArrayDataset, int | None]] = [(datasets.train, 1)]
    moved = epoch_rows(datasets.train, plan, 1)
    if moved is not datasets.train:
        parts.append((moved, 1))
    if datasets.eval is not None:
        parts.append((datasets.eval, None))
    return parts
