"""Data placement on the torch backend: rows gathered from placed arrays equal the host's
(the conformance kit's feed checks, for every kind of rows). (That training gives the same
losses whatever the placement is a conformance check too.)"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.batches import Batch, Datasets
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.rows import stored_rows
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import SCALED_IMAGES_PLAN
from crosstrain.testing.feed_conformance import FeedConformance, FeedUnderTest
from tests.support import scaled_images_on_the_host

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.feed import Feed, gather_rows  # noqa: E402

pytestmark = pytest.mark.torch


class TestTorchFeed(FeedConformance):
    """Every kind of rows, placed on the device or kept on the host, as core reads them."""

    backend = "torch"

    def feed(self, plan: Plan, datasets: Datasets) -> FeedUnderTest:
        feed = Feed("cpu")
        feed.place(plan, datasets)

        def rows(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
            x, y, _, _ = feed.tensors(batch)
            return x.numpy(), y.numpy()

        return FeedUnderTest(feed.placed, rows)


def test_a_full_batchs_indices_are_a_view_of_the_epochs_order_on_the_device() -> None:
    """Placed data: the epoch's order is copied once, each full batch slices it (the same
    storage every step), a padded batch copies its own indices; rows equal the host's."""
    from crosstrain.core.data.batches import ArrayDataset, GlobalSampler, step_batch

    rng = np.random.default_rng(1)
    dataset = ArrayDataset(rng.normal(size=(20, 3)).astype(np.float32), rng.integers(0, 5, 20))
    feed = Feed("cpu")
    x_rows, y_rows = torch.from_numpy(dataset.x), torch.from_numpy(dataset.y)
    feed._placed[id(dataset)] = (lambda i: x_rows[i], lambda i: y_rows[i])  # as place() would
    copies = set()
    for indices, weight in GlobalSampler(num_rows=20, global_batch_size=8, seed=2).epoch(0):
        (batch,) = step_batch(dataset, indices, weight, 0, 1, 1).micro_batches
        x, y, mask, _ = feed.tensors(batch)
        assert np.array_equal(x.numpy(), batch.x) and np.array_equal(y.numpy(), batch.y)
        assert np.array_equal(mask.numpy(), weight)
        if weight.all():  # a full batch: read from the order copied at the epoch's first step
            assert feed._order is not None
            copies.add(id(feed._order[1]))
    assert len(copies) == 1


def test_the_prefetch_threads_gather_a_batchs_rows_straight_into_its_buffer(tmp_path: Path) -> None:
    """What the GPU's host prefetch does (its pinned buffers and side stream need a GPU):
    rows of an in-memory array, or of a memory-mapped file in a reordered view, gathered by
    chunks into one buffer equal numpy's own read of them."""
    rng = np.random.default_rng(0)
    array = rng.normal(size=(1000, 3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", array.reshape(1000, 12))
    file = np.load(tmp_path / "x.npy", mmap_mode="r")
    mapped = MappedRows(file, (3, 4), np.float32, index=np.arange(999, -1, -1))
    indices = rng.integers(0, 1000, 333)  # not a multiple of the threads, with repeats
    with ThreadPoolExecutor(4) as pool:
        for rows in (array, mapped, MappedRows(file, (3, 4), np.float64)):
            found = stored_rows(rows, indices)
            assert found is not None
            source, file_indices, shape = found
            out = np.full((len(file_indices), *source.shape[1:]), np.nan, source.dtype)
            gather_rows(pool, source, file_indices, out)
            # rows read in another dtype are gathered as stored, and cast on the device
            assert np.array_equal(out.reshape(shape).astype(rows.dtype), rows[indices])


def test_host_rows_as_stored_convert_on_the_device_to_the_hosts_bits(write_plan: Callable[..., Path]) -> None:
    """On a GPU, rows kept on the host travel as the file stores them (uint8 pixels) and are
    cast and scaled there (the GPU tests run that path); the conversion gives the bits of
    core's numpy reference, which a CPU, where the host is the device, reads as it is."""
    plan, datasets, batches = scaled_images_on_the_host(write_plan(SCALED_IMAGES_PLAN))
    feed = Feed("cpu")
    feed.place(plan, datasets)
    assert not feed.placed
    assert len(batches) == 2  # the training set's and the eval set's
    for batch in batches:
        stored, dtype, scaling = batch.stored_x()
        assert stored.dtype == np.uint8 and scaling is not None
        x = feed.converter(dtype, scaling)(torch.from_numpy(stored))
        assert x.dtype == torch.float32 and np.array_equal(x.numpy(), batch.x)
        assert np.array_equal(feed.tensors(batch)[0].numpy(), batch.x)


def test_host_placement_and_auto_on_a_cpu_place_nothing(write_plan: Callable[..., Path]) -> None:
    for placement in ("host", "auto"):
        plan = load_plan(write_plan(), [f"data.placement='{placement}'"])
        feed = Feed("cpu")
        feed.place(plan, load_datasets(plan))
        assert not feed.placed
