"""Data placement on the tf backend: rows gathered from placed variables equal the host's.
(That training gives the same losses whatever the placement is a conformance check.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data import load_datasets
from crosstrain.core.plan import load_plan
from crosstrain.testing.plans import GPT_PLAN, RESNET_PLAN, SCALED_IMAGES_PLAN, write_images, write_tokens
from tests.support import scaled_images_on_the_host

tf = pytest.importorskip("tensorflow")

from crosstrain.backends.tf.feed import TfFeed  # noqa: E402

pytestmark = pytest.mark.tf


@pytest.mark.parametrize(
    "text", [RESNET_PLAN, GPT_PLAN, SCALED_IMAGES_PLAN], ids=["arrays", "token-windows", "scaled-uint8"]
)
def test_placed_rows_equal_the_hosts(write_plan: Callable[..., Path], tmp_path: Path, text: str) -> None:
    write_tokens(str(tmp_path / "tokens.npy"))
    write_images(str(tmp_path))
    plan = load_plan(write_plan(text), ["data.placement='device'"])
    datasets = load_datasets(plan)
    feed = TfFeed(tf.distribute.get_strategy(), "cpu")
    feed.place(plan, datasets)
    assert feed.placed
    for part in (datasets.train, datasets.eval):
        assert part is not None
        gathers = feed.gathers(part)
        assert gathers is not None
        indices = np.array([3, 0, 3, len(part) - 1])
        for gather, rows in zip(gathers, (part.x, part.y), strict=True):
            # in a tf.function, as in the steps: Grappler rewrites graphs, not eager ops
            placed = tf.function(gather)(tf.constant(indices)).numpy()
            host = np.asarray(rows[indices])
            assert placed.dtype == host.dtype and np.array_equal(placed, host)


def test_host_rows_are_fed_as_stored_and_scaled_where_the_model_runs(write_plan: Callable[..., Path]) -> None:
    """Rows kept on the host are fed as the file stores them (uint8 pixels); the step casts
    and scales them to the bits of core's numpy reference."""
    plan, datasets, batches = scaled_images_on_the_host(write_plan(SCALED_IMAGES_PLAN))
    feed = TfFeed(tf.distribute.get_strategy(), "cpu")
    feed.place(plan, datasets)
    assert not feed.placed
    assert len(batches) == 2  # the training set's and the eval set's
    for batch in batches:
        stored, dtype, scaling = batch.stored_x()
        assert stored.dtype == np.uint8
        # in a tf.function, as in the steps: Grappler rewrites graphs, not eager ops
        x = tf.function(feed.converter(dtype, scaling))(tf.constant(stored)).numpy()
        assert x.dtype == np.float32 and np.array_equal(x, batch.x)


def test_host_placement_and_auto_on_a_cpu_place_nothing(write_plan: Callable[..., Path]) -> None:
    for placement in ("host", "auto"):
        plan = load_plan(write_plan(), [f"data.placement='{placement}'"])
        feed = TfFeed(tf.distribute.get_strategy(), "cpu")
        feed.place(plan, load_datasets(plan))
        assert not feed.placed
