"""`crosstrain describe`: the model as a table, with no framework started."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from crosstrain.core.model.graph import build_graph
from crosstrain.core.model.layers import Conv1D, Conv2DTranspose, Reshape
from crosstrain.core.spec.planfile import load_plan
from crosstrain.describe import describe_graph
from crosstrain.testing.plans import GPT_PLAN, VISION_PLAN
from tests.conftest import EXAMPLES, run_cli, worker_env


def test_parameters_and_flops_of_a_decoder(write_plan: Callable[..., Path]) -> None:
    description = describe_graph(load_plan(write_plan(GPT_PLAN)).model.graph())
    rows = {row.name: row for row in description.rows}
    assert rows["block_2.0.att"].parameters == 4 * (16 * 16 + 16)
    assert rows["embedding_0"].parameters == 32 * 16
    assert rows["block_2.1.mid"].inputs == "block_2.0.add_8, block_2.1.att_drop"
    assert description.parameters == description.trainable == sum(row.parameters for row in description.rows)
    # per row: dense and attention matmuls, 2 FLOPs per multiply-add
    attention = 4 * 16 * 16 * 16 + 2 * 16 * 16 * 16
    mlp = 16 * 16 * 32 + 16 * 32 * 16
    assert description.flops_per_row == 2 * (2 * (attention + mlp) + 16 * 16 * 32)


def test_parameters_and_flops_of_strided_depthwise_and_transposed_convolutions(
    write_plan: Callable[..., Path],
) -> None:
    """A ResNet's downsampling block and a MobileNetV2 inverted residual: a depthwise
    kernel is [3, 3, 1, channels]; multiply-adds count each output's window of its group."""
    description = describe_graph(load_plan(write_plan(VISION_PLAN)).model.graph())
    rows = {row.name: row for row in description.rows}
    assert (rows["conv2d_3"].output_shape, rows["conv2d_3"].parameters) == ((4, 4, 16), 3 * 3 * 8 * 16)
    assert rows["conv2d_15"].parameters == 3 * 3 * 1 * 32 + 32  # depthwise, with a bias
    assert rows["conv2d_8"].inputs == "stem"
    stem, down, down2, projection = 8 * 8 * 9 * 8, 4 * 4 * 9 * 8 * 16, 4 * 4 * 9 * 16 * 16, 4 * 4 * 8 * 16
    expand, depthwise, project, head = 4 * 4 * 16 * 32, 2 * 2 * 9 * 32, 2 * 2 * 32 * 16, 16 * 10
    assert description.flops_per_row == 2 * (
        stem + down + down2 + projection + expand + depthwise + project + head
    )
    sequence = describe_graph(
        build_graph((10, 4), [Conv1D(filters=6, kernel_size=3, groups=2), Reshape(target_shape=(8, 6, 1))])
    )
    assert sequence.rows[0].parameters == 3 * 2 * 6 + 6 and sequence.flops_per_row == 2 * 8 * 3 * 2 * 6
    upsampling = Conv2DTranspose(filters=2, kernel_size=3, strides=2)
    transposed = describe_graph(build_graph((4, 5, 3), [upsampling]))
    assert transposed.rows[0].output_shape == (9, 11, 2)
    assert transposed.rows[0].parameters == 3 * 3 * 2 * 3 + 2
    assert transposed.flops_per_row == 2 * 4 * 5 * 9 * 3 * 2  # each input position's kernel taps


def test_the_cli_prints_the_table_and_totals() -> None:
    result = run_cli("describe", str(EXAMPLES / "digits_resnet.toml"), env={**worker_env(), "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    assert "block_3.1.branch" in result.stdout and "batchnorm" in result.stdout
    assert "parameters:" in result.stdout and "forward FLOPs per row:" in result.stdout
