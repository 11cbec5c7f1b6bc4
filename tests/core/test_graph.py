"""Model graphs: names, inputs, blocks and repeats resolved before any process starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.planfile import load_plan
from crosstrain.testing.plans import GPT_PLAN, RESNET_PLAN


def test_a_residual_block_repeats_with_its_own_weights(write_plan: Callable[..., Path]) -> None:
    graph = load_plan(write_plan(RESNET_PLAN)).model.graph()
    paths = [node.path for node in graph.nodes]
    assert "res_3.0.branch" in paths and "res_3.1.branch" in paths
    add = next(node for node in graph.nodes if node.path == "res_3.1.add_5")
    # "input" of the second repeat is the first repeat's output
    assert [graph.nodes[i].path for i in add.inputs] == ["res_3.0.relu_6", "res_3.1.branch"]
    weights = graph.init_weights(0)
    assert not np.array_equal(weights["res_3.0.conv2d_0.kernel"], weights["res_3.1.conv2d_0.kernel"])
    assert weights["res_3.0.branch.moving_variance"].tolist() == [1.0] * 8
    assert graph.output_shape == (10,)


def test_a_decoder_has_token_shapes_and_per_position_logits(write_plan: Callable[..., Path]) -> None:
    graph = load_plan(write_plan(GPT_PLAN)).model.graph()
    assert graph.input_dtype == "int32"
    assert graph.output_shape == (16, 32)  # [length, vocabulary]
    specs = graph.weight_specs()
    assert specs["block_2.0.att.query_kernel"].shape == (16, 16)
    assert specs["position_embedding_1.table"].shape == (16, 16)


def test_top_level_weights_keep_their_old_names_and_values(write_plan: Callable[..., Path]) -> None:
    graph = load_plan(write_plan()).model.graph()
    assert sorted(graph.init_weights(3)) == [
        "dense_0.bias",
        "dense_0.kernel",
        "dense_2.bias",
        "dense_2.kernel",
    ]
    # the stream of layer 0 is (seed, 0), as before blocks existed
    limit = np.sqrt(6 / (64 + 32))
    expected = np.random.default_rng([3, 0]).uniform(-limit, limit, size=(64, 32)).astype(np.float32)
    assert np.array_equal(graph.init_weights(3)["dense_0.kernel"], expected)


BAD_GRAPHS = [
    (
        '{ type = "add", inputs = ["input", "nosuch"] }',
        r"model\.blocks\.res\.layers\[5\]\.inputs: no earlier layer named 'nosuch'",
    ),
    ('{ type = "add" }', r"model\.blocks\.res\.layers\[5\]\.inputs: add needs inputs"),
    (
        '{ type = "concat", inputs = ["input", "branch"], name = "branch" }',
        r"the name 'branch' is used twice",
    ),
    ('{ type = "relu", inputs = ["input", "branch"] }', r"relu takes 1 input, got 2"),
    ('{ type = "block", block = "res" }', r"block 'res' contains itself"),
    ('{ type = "block", block = "nosuch" }', r"no block 'nosuch' in model\.blocks"),
    ('{ type = "embedding", vocab_size = 4, units = 2 }', r"embedding reads integer token ids"),
]


@pytest.mark.parametrize(("layer", "message"), BAD_GRAPHS)
def test_a_bad_graph_names_the_field(write_plan: Callable[..., Path], layer: str, message: str) -> None:
    text = RESNET_PLAN.replace('{ type = "add", inputs = ["input", "branch"] }', layer)
    with pytest.raises(PlanError, match=message):
        load_plan(write_plan(text))


def test_shapes_that_do_not_add_up_are_refused(write_plan: Callable[..., Path]) -> None:
    text = RESNET_PLAN.replace(
        '{ type = "batchnorm", name = "branch" }', '{ type = "dense", units = 3, name = "branch" }'
    )
    with pytest.raises(
        PlanError, match=r"model\.blocks\.res\.layers\[5\]: layer 'add_5': add needs inputs of one shape"
    ):
        load_plan(write_plan(text))


def test_token_ids_must_meet_an_embedding(write_plan: Callable[..., Path]) -> None:
    text = GPT_PLAN.replace('{ type = "embedding", vocab_size = 32, units = 16 },', "")
    with pytest.raises(
        PlanError, match=r"model\.layers\[0\]: position_embedding cannot read integer token ids"
    ):
        load_plan(write_plan(text))
