"""Built-in plugin ``tune``: ends a learning-rate range test once its loss diverges.

``crosstrain tune --lr`` runs the plan with ``--tune-divergence FACTOR`` (a hidden option):
once the smoothed step loss exceeds FACTOR times the lowest smoothed loss so far, or is not
finite, the run stops through ``context.request_stop``, as early stopping does. Every rank
sees the same global losses, so every rank decides alike.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

OPTION = "tune_divergence"
DIVERGED = "the loss diverged"
#: the smoothing of the step losses (an exponential moving average, bias-corrected)
SMOOTHING = 0.98


class SmoothedLoss:
    """The bias-corrected moving average of the step losses, and its lowest value so far."""

    def __init__(self, beta: float = SMOOTHING) -> None:
        self.beta, self.average, self.count, self.lowest = beta, 0.0, 0, math.inf

    def add(self, loss: float) -> float:
        self.count += 1
        self.average = self.beta * self.average + (1 - self.beta) * loss
        smoothed = self.average / (1 - self.beta**self.count)
        self.lowest = min(self.lowest, smoothed)
        return smoothed


class DivergenceStop:
    def __init__(self) -> None:
        self.factor: float | None = None
        self.smoothed = SmoothedLoss()

    def start(self, context: RunContext) -> None:
        given = context.options.get(OPTION)
        self.factor = None if given is None else float(given)
        self.smoothed = SmoothedLoss()

    def step(self, context: RunContext, step: int, loss: float) -> None:
        if self.factor is None:
            return
        smoothed = self.smoothed.add(loss) if math.isfinite(loss) else math.inf
        if smoothed > self.factor * self.smoothed.lowest:
            context.request_stop(f"{DIVERGED} at step {step}")
            self.factor = None


_stop = DivergenceStop()


@hookimpl
def crosstrain_addoption(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tune-divergence", dest=OPTION, type=float, default=None, help=argparse.SUPPRESS)


@hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    _stop.start(context)


@hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    _stop.step(context, step, float(metrics["loss"]))
