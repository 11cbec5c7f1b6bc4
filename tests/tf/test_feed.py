"""Data placement on the tf backend: rows gathered from placed variables equal the host's
(the conformance kit's feed checks, for every kind of rows), and rows read ahead to the
replicas' devices train as rows read in the step. (That training gives the same losses
whatever the placement is a conformance check.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.batches import Batch, Datasets
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import SCALED_IMAGES_PLAN, write_images
from crosstrain.testing.feed_conformance import FeedConformance, FeedUnderTest
from crosstrain.testing.plans import DROPOUT_MLP_PLAN
from tests.conftest import json_from_fresh_process
from tests.support import scaled_images_on_the_host

tf = pytest.importorskip("tensorflow")

from crosstrain.backends.tf.feed import TfFeed, host_inputs  # noqa: E402

pytestmark = pytest.mark.tf


class TestTfFeed(FeedConformance):
    """Every kind of rows, placed on the device or kept on the host, as core reads them:
    gathered or converted in a tf.function, as in the steps (Grappler rewrites graphs, not
    eager ops)."""

    backend = "tf"

    def feed(self, plan: Plan, datasets: Datasets) -> FeedUnderTest:
        feed = TfFeed(tf.distribute.get_strategy(), "cpu")
        feed.place(plan, datasets)

        def rows(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
            assert batch.source is not None
            gathers = feed.gathers(batch.source.dataset)
            if gathers is not None:
                indices = tf.constant(batch.source.indices)
                x, y = (tf.function(gather)(indices).numpy() for gather in gathers)
                return x, y
            xs, ys, (dtype, scaling) = host_inputs([batch])
            if xs.dtype == dtype and scaling is None:  # the step takes them as they are
                return xs[0], ys[0]
            return tf.function(feed.converter(dtype, scaling))(tf.constant(xs[0])).numpy(), ys[0]

        return FeedUnderTest(feed.placed, rows)


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


def _on_the_host(text: str, batch: str, epochs: int, accumulation: int) -> str:
    """A plan whose rows stay on the host, trained over ``epochs`` (the loop names every
    step ahead, each epoch's first with the two after it)."""
    text = text.replace("[data]\n", '[data]\nplacement = "host"\n')
    text = text.replace(f"global_batch_size = {batch}\nepochs = 1", "")
    train = f"global_batch_size = 24\nepochs = {epochs}\ngrad_accum_steps = {accumulation}"
    return text.replace("[train]\n", f"[train]\n{train}\n") + "[output]\ncheckpoint = false\n"


def test_rows_read_ahead_to_each_replicas_device_train_as_rows_read_in_the_step(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """Two replicas (logical CPU devices), through core's loop: uint8 images scaled on the
    replicas and float digits with dropout, 24-row steps (the last of each epoch padded),
    two micro-batches; the same losses, to the bit, whether each step's rows were read in
    the step or copied to the replicas' devices while the step before ran."""
    write_images(str(tmp_path))
    plans = [
        write_plan(_on_the_host(SCALED_IMAGES_PLAN, "16", epochs=2, accumulation=2), "images.toml"),
        write_plan(_on_the_host(DROPOUT_MLP_PLAN, "32", epochs=1, accumulation=1), "digits.toml"),
    ]
    results = json_from_fresh_process(
        "tests.tf.workers:prefetch_main", str(tmp_path / "runs"), *map(str, plans), timeout=300
    )
    # 256 and 1,437 training rows: each epoch's last step is padded
    for name, steps, epochs in (("scaled_images", 11, 2), ("dropout_mlp", 60, 1)):
        run = results[name]
        assert len(run["losses"]) == steps * epochs
        assert run["prefetched_losses"] == run["losses"]
        assert run["max_weight_difference"] == 0.0
        # every step, each epoch's first too, found its rows on the replicas' devices
        assert run["prefetched_steps"] == steps * epochs
        assert run["traces"] == [1]  # per-replica rows do not retrace the step
