"""Model graphs: names, inputs, blocks and repeats resolved before any process starts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan
from crosstrain.core.spec.planfile import load_plan
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


def test_seeded_weights_are_made_a_node_at_a_time_and_equal_in_any_order(
    write_plan: Callable[..., Path],
) -> None:
    """What a run builds with: each node's weights made when one is read, the same values
    whichever order they are read in (each node draws from its own stream)."""
    graph = load_plan(write_plan(RESNET_PLAN)).model.graph()
    whole, lazy = graph.init_weights(7), graph.seeded_weights(7)
    assert list(lazy) == list(whole) and len(lazy) == len(whole)
    for name in reversed(list(whole)):  # the last node first, each node's weights out of order
        assert np.array_equal(lazy[name], whole[name]), name
    with pytest.raises(KeyError):
        lazy["no_such_layer.kernel"]


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


KERAS_STYLE = """
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 4, kernel_size = 3, activation = "relu" },
  { type = "flatten" },
  { type = "dense", units = 16, activation = "leaky_relu" },
  { type = "dropout", rate = 0.5 },
  { type = "dense", units = 10 },
]
"""
WRITTEN_OUT = """
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 4, kernel_size = 3 },
  { type = "relu" },
  { type = "flatten" },
  { type = "dense", units = 16 },
  { type = "leaky_relu", negative_slope = 0.2 },
  { type = "dropout", rate = 0.5 },
  { type = "dense", units = 10 },
]
"""


def test_an_activation_is_the_activation_layer_after_its_layer(write_plan: Callable[..., Path]) -> None:
    """Keras's activation = is the same graph as the layers written out: node for node
    (dropout's counter is the node index), the same weight names and initial values."""
    keras_style = load_plan(write_plan(KERAS_STYLE)).model.graph()
    written_out = load_plan(write_plan(WRITTEN_OUT, "out.toml")).model.graph()
    assert [(node.path, node.layer, node.inputs, node.seed_path) for node in keras_style.nodes] == [
        (node.path, node.layer, node.inputs, node.seed_path) for node in written_out.nodes
    ]
    assert keras_style.nodes[1].field == "model.layers[0].activation"
    ours, theirs = keras_style.init_weights(5), written_out.init_weights(5)
    names = [
        f"{layer}.{weight}" for layer in ("conv2d_0", "dense_3", "dense_6") for weight in ("bias", "kernel")
    ]
    assert sorted(ours) == sorted(theirs) == names
    assert all(np.array_equal(ours[name], theirs[name]) for name in ours)


def test_a_layer_named_with_an_activation_is_read_after_it(write_plan: Callable[..., Path]) -> None:
    """As in Keras, a layer's output is its activation's; a default name that counts an
    added activation could mean another layer than the one written there, so it is refused."""
    text = KERAS_STYLE.replace(
        'units = 16, activation = "leaky_relu"', 'units = 16, activation = "tanh", name = "h"'
    )
    named = text.replace('{ type = "dense", units = 10 }', '{ type = "dense", units = 10, inputs = ["h"] }')
    graph = load_plan(write_plan(named)).model.graph()
    assert [graph.nodes[i].path for i in graph.nodes[-1].inputs] == ["tanh_4"]
    by_default = text.replace(
        '{ type = "dense", units = 10 }', '{ type = "dense", units = 10, inputs = ["dropout_5"] }'
    )
    with pytest.raises(PlanError) as refused:
        load_plan(write_plan(by_default))
    assert "model.layers[4].inputs: 'dropout_5' is the default name of model.layers[3], which counts" in str(
        refused.value
    )


def test_a_plan_without_the_newer_fields_is_written_as_before(write_plan: Callable[..., Path]) -> None:
    """Unset, activation, the npz eval keys and model.init stay out of plan.json (its hash
    is what a resumed run checks); set, they round-trip."""
    plain = unstructure_plan(load_plan(write_plan()))
    assert "activation" not in json.dumps(plain) and "eval_x_key" not in plain["data"]
    assert "init" not in plain["model"]
    keras_style = load_plan(write_plan(KERAS_STYLE), ["model.init='weights/init.safetensors'"])
    assert keras_style.model.init == str(write_plan(KERAS_STYLE).parent / "weights" / "init.safetensors")
    assert structure_plan(unstructure_plan(keras_style)) == keras_style
