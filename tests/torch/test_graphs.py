"""Which steps are replayed as one CUDA graph: the table of what blocks a capture. (The
replays themselves need a GPU: tests/torch/test_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from crosstrain.backends.torch.graphs import capture_blocker
from crosstrain.core.plan import load_plan
from crosstrain.testing.conformance import write_plan

pytestmark = pytest.mark.torch


def _blocker(
    tmp_path: Path, name: str, *settings: str, device: str = "cuda:0", processes: int = 1
) -> str | None:
    plan = load_plan(write_plan(tmp_path, name), settings)
    return capture_blocker(plan, device, processes)


def test_one_gpu_process_with_adam_is_captured(tmp_path: Path) -> None:
    assert _blocker(tmp_path, "dropout_mlp") is None
    assert _blocker(tmp_path, "dropout_mlp", "train.precision='bf16'", "train.clip_grad_norm=1.0") is None


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (("train.cuda_graph=false",), "train.cuda_graph is false"),
        (("train.compile=true",), "train.compile replays its own graphs"),
        (("train.grad_accum_steps=2",), "gradient accumulation"),
        (("train.precision='fp16'",), "fp16's loss scaler reads the device"),
        (("train.on_nonfinite='skip'",), 'on_nonfinite = "skip" reads the device'),
        (("optimizer.name='sgd'",), "optimizer 'sgd'"),
    ],
)
def test_what_the_plan_asks_can_block_the_capture(
    tmp_path: Path, settings: tuple[str, ...], reason: str
) -> None:
    assert _blocker(tmp_path, "dropout_mlp", *settings) == reason


def test_the_machine_and_the_model_can_block_the_capture(tmp_path: Path) -> None:
    assert _blocker(tmp_path, "dropout_mlp", device="cpu") == "not on a GPU"
    assert _blocker(tmp_path, "dropout_mlp", processes=2) == "several processes (DDP)"
    assert _blocker(tmp_path, "gpt") == "an embedding's backward syncs with the host (pytorch#82886)"
