"""evaluate(): exact metrics over a whole eval set, the same at any world size, written
against the protocol only (the loop's evaluation between epochs, and ``crosstrain
evaluate``'s)."""

from __future__ import annotations

import math
import sys
from typing import Any

from crosstrain.core.data.batches import ArrayDataset, eval_batches, shard
from crosstrain.core.run.heartbeat import Heartbeat
from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.core.spec.plan import Plan


def evaluate(
    strategy: DistributedStrategy,
    state: Any,
    dataset: ArrayDataset,
    plan: Plan,
    heartbeat: Heartbeat | None = None,
) -> dict[str, float]:
    """Exact metrics over the whole eval set: sums of real rows only, divided once at the end,
    so world N equals world 1 whatever the padding."""
    world = strategy.world
    totals: dict[str, float] = {}
    for indices, weight in eval_batches(dataset, plan.train.global_batch_size):
        batch = shard(dataset, indices, weight, world.process_index, world.process_count)
        if heartbeat is not None:
            heartbeat.beat("eval")
        for name, value in strategy.eval_step(state, batch).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    if heartbeat is not None:
        heartbeat.beat("idle")
    count = totals.get("count", 0.0)
    metrics = {"loss": totals.get("loss_sum", 0.0) / max(count, 1.0), "count": count}
    if "accuracy" in plan.metrics:
        metrics["accuracy"] = totals.get("correct", 0.0) / max(count, 1.0)
    if "top_k_accuracy" in plan.metrics:
        # the backend's vocabulary promised this sum (check_plan_vocabulary): read, not defaulted
        metrics["top_k_accuracy"] = totals["top_k_correct"] / max(count, 1.0) if count else 0.0
    if "perplexity" in plan.metrics:
        metrics["perplexity"] = perplexity(metrics["loss"])
    return metrics


def perplexity(loss: float) -> float:
    """exp of a mean cross-entropy in nats; infinite past float64's range (a diverged run)."""
    return math.inf if loss >= math.log(sys.float_info.max) else math.exp(loss)  # NaN stays NaN
