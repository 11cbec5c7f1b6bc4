"""Built-in plugin ``console``: one line per epoch on rank 0."""

from __future__ import annotations

from collections.abc import Mapping

from crosstrain.core.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl


def format_epoch_line(context: RunContext, epoch: int, metrics: Mapping[str, float]) -> str:
    parts = [f"epoch {epoch + 1}/{context.plan.train.epochs}", f"loss {metrics['loss']:.4f}"]
    if "eval_loss" in metrics:
        parts.append(f"eval_loss {metrics['eval_loss']:.4f}")
    if "eval_accuracy" in metrics:
        parts.append(f"eval_acc {metrics['eval_accuracy']:.4f}")
    parts.append(f"{metrics['samples_per_second']:.0f} samples/s")
    return "  ".join(parts)


@hookimpl
def crosstrain_epoch_end(context: RunContext, epoch: int, metrics: Mapping[str, float]) -> None:
    if context.world.is_main:
        print(format_epoch_line(context, epoch, metrics), flush=True)
