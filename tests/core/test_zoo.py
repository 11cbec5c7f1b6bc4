"""The model zoo (examples/zoo): each plan has its reference implementation's parameter
count, and its small version (crosstrain.testing.zoo, trained by every backend's
conformance suite) loads, fits its data and still runs every kind of block the model has.
No framework: the counts are core's (``crosstrain describe``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from crosstrain.core.data import load_datasets
from crosstrain.core.layers import Block, Layer
from crosstrain.core.plan import Plan, check_world_fits
from crosstrain.core.planfile import load_plan
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
REFERENCE_PARAMETERS = {
    "resnet50": 25_557_032,
    "mobilenet_v2": 3_504_872,
    "unet": 31_037_698,
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
    assert plan.train.precision == "fp64"  # why: crosstrain.testing.zoo
