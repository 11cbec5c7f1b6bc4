"""One plan, two frameworks: torch and tf train the same plan from the same seed to the
same per-step losses (fp32 on CPU, 50 steps), through crosstrain.fit as a user calls it.

Each case changes a few plan fields with overrides, so the plans stay the files under
plans/; between them the cases cover every optimizer, momentum and Nesterov, L2 and
decoupled weight decay, warmup with cosine and step schedules, gradient clipping and
gradient accumulation, on an MLP (LayerNorm, exact GELU) and a small CNN (Conv2D
same/valid, MaxPool2D, channels-last Flatten).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import crosstrain
from crosstrain.core.run.checkpoint import load_checkpoint
from crosstrain.plugins.metrics import METRICS_FILE
from tests.support import max_relative_difference, step_losses, summary

pytest.importorskip("torch")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross

PLANS = Path(__file__).parent / "plans"
STEPS = 50
WARMUP_COSINE = ["schedule.name='cosine'", "schedule.warmup_steps=10", "schedule.min_lr=0.001"]

CASES = {
    "mlp-sgd-momentum": (
        "digits_mlp.toml",
        1e-6,
        ["optimizer.momentum=0.9", "optimizer.weight_decay=0.001", *WARMUP_COSINE],
    ),
    "cnn-sgd-nesterov": (
        "digits_cnn.toml",
        1e-6,
        [
            "optimizer.momentum=0.9",
            "optimizer.nesterov=true",
            "train.clip_grad_norm=1.0",
            "schedule.name='step'",
            "schedule.step_size=20",
            "schedule.gamma=0.5",
        ],
    ),
    "mlp-adam": (
        "digits_mlp.toml",
        1e-4,
        [
            "optimizer.name='adam'",
            "optimizer.lr=0.003",
            "optimizer.weight_decay=0.01",
            "train.grad_accum_steps=2",
        ],
    ),
    "cnn-adam": ("digits_cnn.toml", 1e-4, ["optimizer.name='adam'", "optimizer.lr=0.01", *WARMUP_COSINE]),
    "mlp-adamw": (
        "digits_mlp.toml",
        1e-4,
        [
            "optimizer.name='adamw'",
            "optimizer.lr=0.003",
            "optimizer.weight_decay=0.05",
            "train.clip_grad_norm=0.5",
            *WARMUP_COSINE,
        ],
    ),
    "cnn-adamw": (
        "digits_cnn.toml",
        1e-4,
        [
            "optimizer.name='adamw'",
            "optimizer.lr=0.01",
            "optimizer.weight_decay=0.05",
            "train.grad_accum_steps=2",
        ],
    ),
}


def _fit(plan: str, backend: str, out: Path, overrides: list[str]) -> Path:
    crosstrain.fit(
        PLANS / plan,
        backend=backend,
        nproc=1,
        device="cpu",
        out=out,
        overrides=[f"train.max_steps={STEPS}", *overrides],
    )
    return out


def _lrs(run: Path) -> list[float]:
    import json

    lines = (run / METRICS_FILE).read_text().splitlines()
    return [record["lr"] for record in map(json.loads, lines) if "lr" in record]


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_and_tf_agree_step_by_step(case: str, tmp_path: Path) -> None:
    plan, tolerance, overrides = CASES[case]
    torch_run = _fit(plan, "torch", tmp_path / "torch", overrides)
    tf_run = _fit(plan, "tf", tmp_path / "tf", overrides)
    torch_losses, tf_losses = step_losses(torch_run), step_losses(tf_run)
    assert len(torch_losses) == len(tf_losses) == STEPS
    assert _lrs(tf_run) == _lrs(torch_run)
    difference = max_relative_difference(tf_losses, torch_losses)
    print(f"{case}: max relative per-step loss difference {difference:.3g}")
    assert difference <= tolerance
    # it trained, so agreeing is not vacuous
    assert torch_losses[-10:].mean() < 0.75 * torch_losses[:10].mean()
    # the checkpoints agree too: same neutral names, same layouts, close values
    torch_weights = load_checkpoint(torch_run / "model.safetensors")
    tf_weights = load_checkpoint(tf_run / "model.safetensors")
    assert sorted(torch_weights) == sorted(tf_weights)
    for name, value in torch_weights.items():
        np.testing.assert_allclose(tf_weights[name], value, rtol=1e-3, atol=1e-4, err_msg=name)
    assert summary(tf_run)["eval"]["count"] == summary(torch_run)["eval"]["count"]
