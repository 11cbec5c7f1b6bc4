"""``model.width``: every stated size but the output layer's scaled, the model whole, bad
values refused naming the field; and a block repeated 0 times (the zoo's small versions)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.model.width import scaled_size
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.describe import describe_graph
from crosstrain.testing.plans import GPT_PLAN, RESNET_PLAN, VISION_PLAN
from tests.conftest import run_cli, worker_env


def sizes(plan_path: Path, *settings: str) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, by neutral name."""
    specs = load_plan(plan_path, settings).model.graph().weight_specs()
    return {name: spec.shape for name, spec in specs.items()}


def test_sizes_round_half_up_and_never_reach_zero() -> None:
    assert [scaled_size(size, 0.5) for size in (64, 3, 5, 1)] == [32, 2, 3, 1]
    assert scaled_size(1000, 0.0001) == 1


def test_width_scales_every_size_but_the_output_layer_s(write_plan: Callable[..., Path]) -> None:
    """The residual CNN at half width: convolutions of 4 filters (8 written), blocks
    included, the batch norms following them; the classifier keeps its 10 classes."""
    path = write_plan(RESNET_PLAN)
    half = sizes(path, "model.width=0.5")
    assert half["conv2d_0.kernel"] == (3, 3, 1, 4)
    assert half["res_3.1.conv2d_3.kernel"] == (3, 3, 4, 4)
    assert half["res_3.1.branch.moving_mean"] == (4,)
    assert half["dense_9.kernel"] == (8, 10)  # reads the concat of two 4-channel pools
    assert sizes(path, "model.width=1.0") == sizes(path)


def test_a_depthwise_convolution_keeps_one_group_per_channel(write_plan: Callable[..., Path]) -> None:
    """VISION_PLAN's inverted residual: the depthwise convolution (groups = filters = 32)
    at width 0.25 has 8 filters in 8 groups, reading the 8 channels of the expansion."""
    graph = load_plan(write_plan(VISION_PLAN), ["model.width=0.25"]).model.graph()
    depthwise = next(node for node in graph.nodes if node.path == "conv2d_15")
    assert (depthwise.layer.filters, depthwise.layer.groups) == (8, 8)  # type: ignore[attr-defined]
    assert depthwise.weight_specs()["kernel"].shape == (3, 3, 1, 8)


def test_a_decoder_scales_its_units_and_keeps_its_vocabulary(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan(GPT_PLAN), ["model.width=0.5"])
    specs = plan.model.graph().weight_specs()
    assert specs["embedding_0.table"].shape == (32, 8)  # vocabulary 32, units 16 -> 8
    assert specs["block_2.1.att.query_kernel"].shape == (8, 8)
    assert specs["dense_4.kernel"].shape == (8, 32)  # logits over the whole vocabulary
    full = describe_graph(load_plan(write_plan(GPT_PLAN)).model.graph())
    assert describe_graph(plan.model.graph()).parameters < full.parameters / 2


BAD_WIDTHS = [
    ("model.width=0", "model.width: must be > 0, got 0.0"),
    ("model.width='half'", "model.width: expected a number, got 'half'"),
    ("model.width=0.3", "model.blocks.decoder.layers[1]: layer 'att': 5 units do not split"),
]


@pytest.mark.parametrize(("setting", "message"), BAD_WIDTHS)
def test_a_bad_width_is_refused_naming_the_field(
    write_plan: Callable[..., Path], setting: str, message: str
) -> None:
    with pytest.raises(PlanError) as refused:
        load_plan(write_plan(GPT_PLAN), [setting])
    assert message in str(refused.value)
    if setting == "model.width=0.3":  # a misfit the written plan does not have says what made it
        assert str(refused.value).endswith("(at model.width = 0.3)")


def test_width_needs_one_layer_whose_size_is_the_output_s(write_plan: Callable[..., Path]) -> None:
    """A model whose output is a sum of two branches has no one output layer to keep."""
    two_heads = """
        [model]
        input_shape = [64]
        layers = [
          { type = "dense", units = 10, name = "a" },
          { type = "dense", units = 10, inputs = ["input"], name = "b" },
          { type = "add", inputs = ["a", "b"] },
        ]
    """
    with pytest.raises(PlanError) as refused:
        load_plan(write_plan(two_heads), ["model.width=0.5"])
    assert "model.width: going back from the output reaches 'add'" in str(refused.value)
    load_plan(write_plan(two_heads))  # as written it is a model


def test_a_native_model_takes_no_width(write_plan: Callable[..., Path]) -> None:
    native = """
        [model]
        input_shape = [64]
        native = { torch = "mine:build" }
    """
    with pytest.raises(PlanError, match="width scales a plan's layers; a native model"):
        load_plan(write_plan(native), ["model.width=0.5"])


def test_width_stays_out_of_plan_json_at_1_and_round_trips(write_plan: Callable[..., Path]) -> None:
    """plan.json's hash is what a resumed run checks: a plan without width hashes as before."""
    plain = unstructure_plan(load_plan(write_plan()))
    assert "width" not in plain["model"]
    narrow = load_plan(write_plan(), ["model.width=0.25"])
    assert json.loads(json.dumps(unstructure_plan(narrow)))["model"]["width"] == 0.25
    assert structure_plan(unstructure_plan(narrow)) == narrow


def test_a_block_repeated_0_times_is_left_out(write_plan: Callable[..., Path]) -> None:
    """Its name then stands for its input, so the layers after it read what it would have."""
    path = write_plan(RESNET_PLAN)
    graph = load_plan(path, ["model.layers[3].repeat=0"]).model.graph()
    assert not any(node.path.startswith("res_3.") for node in graph.nodes)
    assert graph.output_shape == (10,)
    with pytest.raises(PlanError, match=r"model\.layers\[3\]\.repeat: must be >= 0, got -1"):
        load_plan(path, ["model.layers[3].repeat=-1"])


def test_describe_says_the_width_it_shows(write_plan: Callable[..., Path]) -> None:
    path = write_plan(RESNET_PLAN)
    wide = {**worker_env(), "COLUMNS": "160"}
    result = run_cli("describe", str(path), "--set", "model.width=0.5", env=wide)
    assert result.returncode == 0, result.stderr
    assert "tiny_resnet: input [8, 8, 1] float32, width 0.5" in result.stdout
    assert "trainable 814" in result.stdout
