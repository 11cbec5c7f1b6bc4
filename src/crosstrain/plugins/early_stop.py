"""Built-in plugin ``early_stop``: end training when an eval metric stops improving.

``crosstrain run PLAN --early-stop eval.loss --patience 3 --min-delta 0.001`` stops once
``eval.loss`` has not improved by more than ``min_delta`` over ``patience`` evaluations in a
row, through ``context.request_stop``: the run ends normally (exit 0) and summary.json says
why. ``--restore-best`` then makes the final weights those of the best evaluation, from the
checkpoint ``output.keep_best`` (naming the same metric) keeps.

Every rank sees the same global eval metrics, so every rank decides alike; no collective.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import attrs

from crosstrain.core.errors import PlanError
from crosstrain.core.run.checkpoint import KEEP_BEST
from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl


@attrs.define
class _Monitor:
    metric: str  # "eval.loss" or "eval.accuracy": a key of KEEP_BEST
    patience: int
    min_delta: float
    best: float | None = None
    best_step: int | None = None
    waited: int = 0

    def update(self, value: float, step: int) -> bool:
        """Record an evaluation; True when patience has run out."""
        larger_is_better = KEEP_BEST[self.metric][1]
        gain = (
            (value - self.best if larger_is_better else self.best - value) if self.best is not None else None
        )
        if gain is None or gain > self.min_delta:
            self.best, self.best_step, self.waited = value, step, 0
            return False
        self.waited += 1
        return self.waited >= self.patience


_monitor: _Monitor | None = None  # this process runs one training: one monitor


@hookimpl
def crosstrain_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("early stopping (plugin early_stop)")
    group.add_argument(
        "--early-stop", choices=sorted(KEEP_BEST), default=None, help="stop when this metric stops improving"
    )
    group.add_argument("--patience", type=int, default=3, help="evaluations without improvement (default 3)")
    group.add_argument("--min-delta", type=float, default=0.0, help="the least change that counts as better")
    group.add_argument(
        "--restore-best",
        action="store_true",
        help="end with the best evaluation's weights (needs output.keep_best = the same metric)",
    )


@hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    global _monitor
    options = context.options
    metric = options.get("early_stop")
    _monitor = None
    if metric is None:
        return
    if options.get("restore_best") and context.plan.output.keep_best != metric:
        raise PlanError(
            f"--restore-best needs output.keep_best = {metric!r} (the checkpoint it restores)",
            field="output.keep_best",
            source=context.plan.source,
        )
    _monitor = _Monitor(str(metric), int(options.get("patience", 3)), float(options.get("min_delta", 0.0)))


@hookimpl
def crosstrain_eval_end(context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
    monitor = _monitor
    if monitor is None:
        return
    name = KEEP_BEST[monitor.metric][0]
    if monitor.update(float(metrics[name]), step):
        reason = (
            f"early stopping: {monitor.metric} did not improve by more than {monitor.min_delta} "
            f"for {monitor.patience} evaluations (best {monitor.best:.6g} at step {monitor.best_step})"
        )
        context.request_stop(reason, restore_best=bool(context.options.get("restore_best")))
