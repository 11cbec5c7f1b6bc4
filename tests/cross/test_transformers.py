"""tf against the torch reference through the CLI: the zoo's GPT-2 small with tied embeddings
(scaled down, on token data) with its eval perplexity, and binary cross-entropy on
multi-label digits, which also trains at world 2 as at world 1. (GPT-2's and the Llama's
layers, label smoothing, the top-k accuracy and decay on kernels only are in every backend's
conformance plans, crosstrain.testing.launches.PLANS: the GPT-2 runs here are the suite's.)"""

from __future__ import annotations

import math

import pytest

from crosstrain.testing.launches import RunCache
from crosstrain.testing.run_checks import PARITY_TOLERANCE, WORLD_TOLERANCE
from crosstrain.testing.runs import assert_same_eval, max_relative_difference, step_losses, summary

pytest.importorskip("torch")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross


def test_a_gpt2_style_decoder_with_tied_embeddings_agrees_with_torch(runs: RunCache) -> None:
    reference, mine = runs("torch", "gpt2_small", 2), runs("tf", "gpt2_small", 2)
    assert len(step_losses(reference)) >= 10
    assert max_relative_difference(step_losses(mine), step_losses(reference)) <= PARITY_TOLERANCE
    evaluation = summary(mine)["eval"]
    assert_same_eval(evaluation, summary(reference)["eval"], loss_tolerance=PARITY_TOLERANCE, flips=1)
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["loss"]), rel=1e-12)
    assert "eval perplexity" in (mine / "stdout.txt").read_text()


def test_binary_cross_entropy_agrees_with_torch_and_at_world_2(runs: RunCache) -> None:
    one, two = runs("torch", "multilabel", 1), runs("torch", "multilabel", 2)
    mine = runs("tf", "multilabel", 2)
    assert max_relative_difference(step_losses(two), step_losses(one)) <= WORLD_TOLERANCE
    assert max_relative_difference(step_losses(mine), step_losses(two)) <= PARITY_TOLERANCE
    assert_same_eval(summary(two)["eval"], summary(one)["eval"], loss_tolerance=WORLD_TOLERANCE)
    assert_same_eval(summary(mine)["eval"], summary(two)["eval"], loss_tolerance=PARITY_TOLERANCE)
    # four labels a row, each its own sigmoid: the loss starts near log 2 and learns
    losses = step_losses(one)
    assert abs(losses[0] - math.log(2)) < 0.1 and losses[-3:].mean() < losses[:3].mean()
