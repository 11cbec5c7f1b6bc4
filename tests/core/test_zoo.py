"""The model zoo (examples/zoo): each plan has its reference implementation's parameter
count, and its small version (crosstrain.testing.zoo, trained by every backend's
conformance suite) loads, fits its data and still runs every kind of block the model has.
No framework: the counts are core's (``crosstrain describe``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from crosstrain.core.model.layers import Block, Layer
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan import Plan, check_world_fits
from crosstrain.core.spec.planfile import load_plan
from crosstrain.describe import describe_graph
from crosstrain.testing.zoo import ZOO
from tests.conftest import EXAMPLES, run_cli, worker_env

ZOO_DIR = EXAMPLES / "zoo"

#: trainable parameters of each reference implementation (batch norm's running statistics
#: are buffers there, not parameters; crosstrain counts them as weights, not trainable).
#: torchvision is not installed here: its counts are those its model builders document
#: (torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["num_params"] = 25,557,032;
#: MobileNet_V2_Weights.IMAGENET1K_V1.meta["num_params"] = 3,504,872), and each was also
#: obtained by rebuilding the architecture from torchvision's source in plain torch
#: (torchvision/models/resnet.py's Bottleneck, layers [3, 4, 6, 3]; mobilenetv2.py's
#: inverted residual settings at width_mult 1.0) and summing ``p.numel()`` over
#: ``model.parameters()``. The U-Net is milesial/Pytorch-UNet at commit 21d7850
#: (unet/unet_model.py, unet/unet_parts.py: bias-free 3x3 convolutions with batch norm,
#: ConvTranspose2d(in, in // 2, 2, stride=2) up) as its train.py builds it by default,
#: UNet(n_channels=3, n_classes=2, bilinear=False): its two files' classes rebuilt in plain
#: torch the same way give 31,037,698 (31,037,763 with n_classes=3).
#:
#: The transformers, each also rebuilt in plain torch from its reference's source (module by
#: module, on the meta device) and its unique parameters summed, tied weights once:
#: ViT-B/16 is torchvision.models.vit_b_16 (ViT_B_16_Weights.IMAGENET1K_V1.meta["num_params"]
#: = 86,567,656; vision_transformer.py: a 16x16 stride-16 conv_proj with bias, class token,
#: 197 learned positions, 12 EncoderBlocks of LayerNorm, nn.MultiheadAttention(768, 12),
#: MLP 3072, the 1000-class head). GPT-2 small is Hugging Face's GPT2LMHeadModel(GPT2Config())
#: (vocabulary 50,257, 1,024 positions, 12 layers of 768; lm_head tied to wte, no bias):
#: model.num_parameters() = 124,439,808. The Llama is LlamaForCausalLM with TinyLlama-1.1B's
#: config (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T: vocabulary 32,000, hidden
#: 2,048, intermediate 5,632, 22 layers, 32 heads, 4 key/value heads, untied, no biases):
#: 1,100,048,384, also the published formula 2·V·d + L·(2·d² + 2·d·(d·kv/h) + 3·d·ffn + 2·d) + d.
REFERENCE_PARAMETERS = {
    "resnet50": 25_557_032,
    "mobilenet_v2": 3_504_872,
    "unet": 31_037_698,
    "vit_b16": 86_567_656,
    "gpt2_small": 124_439_808,
    "llama": 1_100_048_384,
}


def small_plan(name: str, directory: Path) -> Plan:
    """The zoo plan's small version, its data written where the plan reads it."""
    (directory / ZOO[name].file).write_text(ZOO[name].text)
    ZOO[name].write_data(directory)
    return load_plan(directory / ZOO[name].file, ZOO[name].small)


@pytest.mark.parametrize("name", sorted(REFERENCE_PARAMETERS))
def test_each_plan_has_its_reference_s_parameter_count(name: str) -> None:
    description = describe_graph(load_plan(ZOO_DIR / ZOO[name].file).model.graph())
    assert description.trainable == REFERENCE_PARAMETERS[name]


def test_describe_prints_resnet50_s_count_and_flops() -> None:
    """Through the CLI as the zoo's page shows it: 4.09 G multiply-adds, torchvision's
    GFLOPS figure for ResNet-50, is 8.18 G FLOPs."""
    result = run_cli("describe", str(ZOO_DIR / "resnet50.toml"), env={**worker_env(), "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    assert "trainable 25,557,032 (25.56 M)" in result.stdout
    assert "forward FLOPs per row: 8,178,368,512 (8.18 G)" in result.stdout


def test_describe_prints_the_transformers_counts() -> None:
    """ViT-B/16's 35.13 G FLOPs are torchvision's 17.56 GFLOPS (multiply-adds); GPT-2's
    output dense is its token embedding, counted once."""
    env = {**worker_env(), "COLUMNS": "160"}
    vit = run_cli("describe", str(ZOO_DIR / "vit_b16.toml"), env=env)
    assert vit.returncode == 0, vit.stderr
    assert "trainable 86,567,656 (86.57 M)" in vit.stdout
    assert "forward FLOPs per row: 35,127,656,448 (35.13 G)" in vit.stdout
    gpt2 = run_cli("describe", str(ZOO_DIR / "gpt2_small.toml"), env=env)
    assert gpt2.returncode == 0, gpt2.stderr
    assert "trainable 124,439,808 (124.44 M)" in gpt2.stdout and "dense (tied to tokens)" in gpt2.stdout


def test_the_suite_trains_the_zoo_s_plans_word_for_word() -> None:
    shipped = sorted(path.name for path in ZOO_DIR.glob("*.toml"))
    assert sorted(model.file for model in ZOO.values()) == shipped == sorted(f"{name}.toml" for name in ZOO)
    for model in ZOO.values():
        assert (ZOO_DIR / model.file).read_text() == model.text, model.file


def _kind(layers: tuple[Layer, ...]) -> tuple[tuple[object, ...], ...]:
    """A block's layers without their sizes: types, strides, groups or not, connections."""
    return tuple(
        (layer.type, getattr(layer, "strides", None), getattr(layer, "groups", 1) > 1, layer.inputs)
        for layer in layers
    )


@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_small_version_fits_its_data_and_runs_every_kind_of_block(name: str, tmp_path: Path) -> None:
    plan = small_plan(name, tmp_path)
    check_world_fits(plan, 2)
    data = load_datasets(plan)
    assert data.train.x.shape[1:] == plan.model.input_shape
    graph = plan.model.graph()
    run = {layer.block for layer in plan.model.layers if isinstance(layer, Block) and layer.repeat}
    kinds = {name: _kind(block.layers) for name, block in plan.model.blocks.items()}
    assert {kinds[name] for name in run} == set(kinds.values())  # only sizes tell those left out apart
    full = describe_graph(load_plan(ZOO_DIR / ZOO[name].file).model.graph())
    small = describe_graph(graph)
    assert small.flops_per_row < full.flops_per_row / 1000  # seconds on a CPU, not hours
    normalised = any(node.layer.type == "batchnorm" for node in graph.nodes)
    # why: crosstrain.testing.zoo (batch norm over few rows amplifies fp32's rounding)
    assert plan.train.precision == ("fp64" if normalised else "fp32")


@pytest.mark.parametrize("name", ["vit_b16", "gpt2_small", "llama"])
def test_a_transformer_s_small_version_is_tiny(name: str, tmp_path: Path) -> None:
    """The suite trains every small version on every backend at worlds 1 and 2: the
    transformers' stay at a few thousand weights and sequences of at most 16."""
    graph = small_plan(name, tmp_path).model.graph()
    assert describe_graph(graph).trainable < 8000
    sequences = [node.output_shape for node in graph.nodes if node.layer.type == "attention"]
    assert sequences and max(length for length, _ in sequences) <= 16
