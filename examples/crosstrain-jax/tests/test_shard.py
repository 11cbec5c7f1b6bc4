"""``train.shard`` on the jax plugin beyond the conformance suite's dropout MLP: the zoo's
GPT-2 (block repeats, a tied output, dropout, AdamW on kernels, ``clip_grad_norm = 1.0``)
sharded trains as the unsharded world-2 run does. Clipping divides by the global norm:
under ``"full"`` each device sums its parts' squares and XLA sums those, in other pieces
than the unsharded sum may, so the bound is the suite's rounding one (measured on a CPU:
bit for bit, both modes)."""

from __future__ import annotations

import pytest
from crosstrain.testing.conformance import SHARD_TOLERANCE, SHARDED_PARTS
from crosstrain.testing.launches import RunCache, SharesRuns
from crosstrain.testing.runs import assert_same_eval, max_relative_difference, step_losses, summary


class TestShardedGpt2(SharesRuns):
    """The world-2 unsharded run is the conformance suite's own (one run per session)."""

    @pytest.mark.parametrize("mode", ["optimizer", "full"])
    def test_clipped_and_sharded_it_trains_as_the_unsharded_world(
        self, runs: RunCache, mode: str
    ) -> None:
        plain = runs("jax", "gpt2_small", 2)
        sharded = runs("jax", "gpt2_small", 2, f"train.shard='{mode}'")
        assert max_relative_difference(step_losses(sharded), step_losses(plain)) <= SHARD_TOLERANCE
        assert_same_eval(
            summary(sharded)["eval"], summary(plain)["eval"], loss_tolerance=SHARD_TOLERANCE
        )
        replicated, held = summary(plain)["memory_per_rank"], summary(sharded)["memory_per_rank"]
        divided = SHARDED_PARTS[mode]
        share = sum(held[part] for part in divided) / sum(replicated[part] for part in divided)
        assert 0.45 <= share <= 0.55, (held, replicated)
