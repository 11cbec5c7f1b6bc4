"""`crosstrain describe`: the model as a table, with no framework started."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from crosstrain.core.planfile import load_plan
from crosstrain.describe import describe_graph
from crosstrain.testing.plans import GPT_PLAN
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


def test_the_cli_prints_the_table_and_totals() -> None:
    result = run_cli("describe", str(EXAMPLES / "digits_resnet.toml"), env={**worker_env(), "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    assert "block_3.1.branch" in result.stdout and "batchnorm" in result.stdout
    assert "parameters:" in result.stdout and "forward FLOPs per row:" in result.stdout
