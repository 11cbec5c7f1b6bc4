"""The torch backend's tables and layers against core's names and numpy references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.model.dropout import keep_mask as reference_keep_mask
from crosstrain.core.model.layers import (
    LAYER_TYPES,
    BatchNorm,
    Block,
)
from crosstrain.core.spec.plan import ModelSpec, Plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import missing_names
from crosstrain.testing.layer_cases import case_plan
from crosstrain.testing.plans import GPT_PLAN, RESNET_PLAN

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.dense import keep_mask  # noqa: E402
from crosstrain.backends.torch.layers import LAYERS  # noqa: E402
from crosstrain.backends.torch.model import build_module, load_neutral, neutral_state  # noqa: E402
from crosstrain.backends.torch.strategy import TorchStrategy  # noqa: E402

pytestmark = pytest.mark.torch


def test_the_tables_cover_every_core_name() -> None:
    assert missing_names(TorchStrategy.vocabulary()) == {}
    assert set(LAYERS) == set(LAYER_TYPES) - {Block.type}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_every_row_lays_out_every_weight_of_its_layer(kind: str) -> None:
    """A row without a layout for a weight its layer has would leave that weight out of
    every checkpoint: each weight of the type's shared case sits in its row's layout."""
    plan = case_plan(kind)
    (node,) = (node for node in plan.model.graph().nodes if node.layer.type == kind)
    assert set(node.weight_specs()) <= set(LAYERS[kind].layout)


def test_dropout_masks_equal_the_numpy_reference_bit_for_bit() -> None:
    rows = np.array([0, 5, 17, 2**31 + 3, 2**32 - 1], np.int64)
    for seed, step, layer, rate in ((0, 0, 0, 0.5), (2**40 + 7, 123_456, 9, 0.1), (5, 2**33, 3, 0.9)):
        expected = reference_keep_mask(seed, step, layer, rows, 777, rate)
        actual = keep_mask(seed, step, layer, torch.from_numpy(rows), 777, rate).numpy()
        assert np.array_equal(actual, expected)


def test_batch_norm_uses_real_rows_only_and_moves_its_statistics() -> None:
    plan = Plan(model=ModelSpec(input_shape=(3, 3, 2), layers=(BatchNorm(momentum=0.5),)))
    module = build_module(plan)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 3, 2)).astype(np.float32)
    weight = np.array([1, 1, 1, 0], np.float32)  # the last row is padding
    out = module(torch.from_numpy(x), torch.from_numpy(weight)).detach().numpy()
    real = x[:3].reshape(-1, 2)
    mean, variance = real.mean(0), real.var(0)
    np.testing.assert_allclose(out[:3], (x[:3] - mean) / np.sqrt(variance + 1e-5), rtol=1e-5, atol=1e-5)
    state = neutral_state(module, plan)
    np.testing.assert_allclose(state["batchnorm_0.moving_mean"], 0.5 * mean, rtol=1e-6)
    unbiased = variance * len(real) / (len(real) - 1)
    np.testing.assert_allclose(state["batchnorm_0.moving_variance"], 0.5 + 0.5 * unbiased, rtol=1e-6)
    module.eval()  # evaluation uses the moving statistics
    evaluated = module(torch.from_numpy(x)).detach().numpy()
    expected = (x - 0.5 * mean) / np.sqrt(0.5 + 0.5 * unbiased + 1e-5)
    np.testing.assert_allclose(evaluated, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text", [RESNET_PLAN, GPT_PLAN], ids=["resnet", "gpt"])
def test_weights_round_trip_with_running_statistics(write_plan: Callable[..., Path], text: str) -> None:
    plan = load_plan(write_plan(text))
    weights = plan.model.graph().init_weights(plan.seed)
    moved = {name: value + np.float32(0.25) for name, value in weights.items()}
    module = build_module(plan)
    load_neutral(module, plan, moved)
    state = neutral_state(module, plan)
    assert sorted(state) == sorted(weights)
    for name, value in moved.items():
        assert np.array_equal(state[name], value), name
