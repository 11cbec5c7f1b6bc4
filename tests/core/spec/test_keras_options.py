"""The layer options Keras models need: dropout per row, 'same' pools, batch norm without
scale or offset, per-channel rescale, take. Their fields stay out of plan.json at their
defaults (a run written before them keeps its plan hash), and their shapes are checked."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from crosstrain.core.model.layers import AvgPool2D, BatchNorm, Dropout, MaxPool2D, Rescale, Take
from crosstrain.core.run.checkpoint import plan_hash
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan

PLAN = """
[model]
input_shape = [8, 8, 3]
layers = [
  {type = "rescale", scale = 0.5, offset = -1},
  {type = "conv2d", filters = 4, kernel_size = 3},
  {type = "batchnorm"},
  {type = "maxpool2d"},
  {type = "avgpool2d", pool_size = 1},
  {type = "dropout", rate = 0.25},
  {type = "flatten"},
  {type = "dense", units = 10},
]
"""


def test_a_plan_without_the_new_options_hashes_as_before() -> None:
    plan = structure_plan(tomllib.loads(PLAN))
    assert plan_hash(plan) == "93052d7b35c4a072"  # its hash before the options existed
    layers = unstructure_plan(plan)["model"]["layers"]
    assert layers[0] == {"type": "rescale", "scale": 0.5, "offset": -1.0}
    for left_out in ("per_row", "padding", "scale", "center"):
        assert all(left_out not in layer for layer in layers[2:6])


def test_the_new_options_round_trip() -> None:
    raw = tomllib.loads(PLAN)
    raw["model"]["layers"][0] = {"type": "rescale", "scale": [1, 2, 3], "offset": [0.5, 0, -1]}
    raw["model"]["layers"][2] = {"type": "batchnorm", "scale": False, "center": False}
    raw["model"]["layers"][3] = {"type": "maxpool2d", "padding": "same"}
    raw["model"]["layers"][5] = {"type": "dropout", "per_row": True}
    plan = structure_plan(raw)
    assert structure_plan(unstructure_plan(plan)) == plan
    layers = plan.model.layers
    assert layers[0] == Rescale(scale=(1.0, 2.0, 3.0), offset=(0.5, 0.0, -1.0))
    assert layers[2] == BatchNorm(scale=False, center=False)
    assert layers[3] == MaxPool2D(padding="same") and layers[5] == Dropout(per_row=True)
    weights = plan.model.graph().weight_specs()
    assert not any(name.endswith((".scale", ".offset")) for name in weights)


def test_a_same_pool_counts_the_real_cells_of_each_window() -> None:
    """7 rows at window 3, stride 2: one padding row above and below; 6 columns: one after."""
    pool = AvgPool2D(pool_size=3, strides=2, padding="same")
    assert pool.output_shape((7, 6, 3)) == (4, 3, 3)
    assert pool.paddings((7, 6, 3)) == ((1, 1), (0, 1))
    counts = np.outer([2, 3, 3, 2], [3, 3, 2])
    np.testing.assert_array_equal(pool.real_counts((7, 6, 3)), counts)
    np.testing.assert_array_equal(AvgPool2D(pool_size=2).real_counts((5, 4, 1)), np.full((2, 2), 4))


def test_a_per_channel_rescale_must_match_the_channels() -> None:
    with pytest.raises(ValueError, match="scale has 2 values; the input's last axis has 3"):
        Rescale(scale=(1.0, 2.0)).output_shape((4, 4, 3))
    assert Rescale(scale=2.0, offset=(1.0, 2.0, 3.0)).output_shape((4, 3)) == (4, 3)


def test_take_reads_one_position_of_the_first_axis() -> None:
    assert Take().output_shape((5, 4)) == (4,)
    assert Take(index=-5).output_shape((5, 4, 2)) == (4, 2)
    with pytest.raises(ValueError, match=r"index 5 is outside the first axis of \[5, 4\]"):
        Take(index=5).output_shape((5, 4))
