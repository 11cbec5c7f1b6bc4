"""The same plan on torch and on jax: identical initial weights and batches, so the per-step
losses agree to float rounding, across frameworks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from jaxtest_support import (
    CNN_PLAN,
    EXAMPLES,
    max_relative_difference,
    run_cli,
    step_losses,
)

pytestmark = pytest.mark.torch

DIGITS = EXAMPLES / "digits_mlp.toml"


@pytest.fixture(autouse=True)
def _needs_torch() -> None:
    pytest.importorskip("torch")


def _losses(backend: str, plan: Path, out: Path, *overrides: str) -> np.ndarray:
    args = ["run", str(plan), "--backend", backend, "--device", "cpu", "--out", str(out / backend)]
    for override in overrides:
        args += ["--set", override]
    result = run_cli("-p", "no:tf", *args)
    assert result.returncode == 0, result.stderr
    return step_losses(out / backend)


def _parity(plan: Path, out: Path, *overrides: str) -> float:
    torch_losses = _losses("torch", plan, out, *overrides)
    jax_losses = _losses("jax", plan, out, *overrides)
    assert len(jax_losses) == len(torch_losses) > 0
    return max_relative_difference(jax_losses, torch_losses)


def test_sgd_momentum_on_the_digits_mlp_matches_torch(tmp_path: Path) -> None:
    sgd = ("train.max_steps=50", "optimizer.name='sgd'", "optimizer.lr=0.05",
           "optimizer.momentum=0.9")
    assert _parity(DIGITS, tmp_path, *sgd) <= 1e-6


def test_every_image_layer_type_and_a_padding_only_micro_batch_match_torch(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    # the graph (add, concat), conv pairs, both poolings, NHWC flatten order, layernorm,
    # batch norm over the global batch, hash dropout (the same masks in every framework),
    # exact gelu, clipping, accumulation; and step 8 of CNN_PLAN: 16 real rows then 16 of
    # padding, cut into two micro-batches
    torch_losses = _losses("torch", write_plan(CNN_PLAN), tmp_path)
    jax_losses = _losses("jax", write_plan(CNN_PLAN), tmp_path)
    assert len(jax_losses) == len(torch_losses) == 8
    assert max_relative_difference(jax_losses, torch_losses) <= 1e-5


# the Adam MLP and the token model against torch: crosstrain's AgreesWithTorch
# (test_conformance.py), on the dropout MLP with Adam and the GPT with causal attention
