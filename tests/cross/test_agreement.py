"""tf against the torch reference on the conformance plans (dropout MLP, residual CNN with
batch norm, GPT with dropout), in fp64 far tighter than in fp32, and on the shipped examples
(the Keras MNIST-style MLP with Dropout(0.5), the residual network, the decoder) through
`crosstrain compare`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crosstrain.plot import build_figure  # matplotlib: the plot extra, in the test extra
from crosstrain.testing.agreement import AgreesWithTorch
from crosstrain.testing.launches import RunCache
from crosstrain.testing.runs import max_relative_difference, step_losses
from tests.conftest import EXAMPLES, run_cli

pytest.importorskip("torch")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross


class TestTfAgreesWithTorch(AgreesWithTorch):
    backend = "tf"


#: fp64's step losses of tf and torch, relative: fp32's rounding (~1e-7) is 2**29 times fp64's
FP64_TOLERANCE = 1e-10


def test_in_fp64_the_frameworks_agree_far_longer_than_in_fp32(runs: RunCache) -> None:
    """``train.precision = "fp64"`` on the residual network (batch norm, ReLU: rounding
    differences grow there first): every step's loss of tf within 1e-10 of torch's, where
    fp32's differ by more (the fp32 runs are the parity check's own)."""
    fp64 = "train.precision='fp64'"
    wide = max_relative_difference(
        step_losses(runs("tf", "resnet", 2, fp64)), step_losses(runs("torch", "resnet", 2, fp64))
    )
    narrow = max_relative_difference(
        step_losses(runs("tf", "resnet", 2)), step_losses(runs("torch", "resnet", 2))
    )
    assert wide <= FP64_TOLERANCE < narrow, (wide, narrow)


@pytest.mark.parametrize(
    ("example", "settings"),
    [
        ("digits_keras_mlp.toml", []),
        ("digits_resnet.toml", []),
        # the example's model, on 8 rows a step of the corpus' first 600 windows: enough to see
        # 30 steps agree, at a quarter of the example's batch
        ("stdlib_gpt.toml", ["data.limit=600", "train.global_batch_size=8"]),
    ],
)
def test_the_examples_agree_for_30_steps_at_two_replicas(
    tmp_path: Path, example: str, settings: list[str]
) -> None:
    """Through ``crosstrain compare`` as a user runs it: the verdict, the largest step-loss
    difference printed, and a compare folder that lists its runs (the reference first) and
    plots as them."""
    overrides = [item for setting in ["train.max_steps=30", *settings] for item in ("--set", setting)]
    result = run_cli(
        "-p", "no:progress", "compare", str(EXAMPLES / example), "--backends", "torch,tf", "--nproc", "2",
        "--device", "cpu", "--tolerance", "1e-4", "--out", str(tmp_path), *overrides, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: AGREE" in result.stdout and "max rel. step-loss" in result.stdout
    listed = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert listed == [
        {"backend": "torch", "folder": "torch", "role": "reference", "seed": 0},
        {"backend": "tf", "folder": "tf", "role": "candidate", "seed": 0},
        {"backend": "torch", "folder": "torch-fp64", "role": "fp64", "seed": 0, "probes": "torch"},
        {"backend": "tf", "folder": "tf-fp64", "role": "fp64", "seed": 0, "probes": "tf"},
    ]
    labels = [line.get_label() for line in build_figure([tmp_path]).axes[0].get_lines()]
    assert labels == [f"{tmp_path.name}/torch", f"{tmp_path.name}/tf"]
