"""The run context every lifecycle hook receives."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from crosstrain.core.plan import Plan
from crosstrain.core.strategy import Job, World


@attrs.define
class StopRequest:
    """A plugin's request to end training (``RunContext.request_stop``); the one mutable
    part of the context, read by the loop."""

    reason: str | None = None
    restore_best: bool = False  # end with the weights of output.keep_best's checkpoint


@attrs.frozen
class RunContext:
    """What a plugin may want to know about the run in progress."""

    job: Job
    world: World
    total_steps: int
    steps_per_epoch: int
    train_rows: int
    eval_rows: int
    #: optimizer steps already done when this run started: a resumed run's checkpoint step
    start_step: int = 0
    stop: StopRequest = attrs.field(factory=StopRequest, eq=False, repr=False)

    def request_stop(self, reason: str, restore_best: bool = False) -> None:
        """Ask the loop to end training normally (exit 0; the summary says ``reason``).

        Any rank may ask; the ranks agree after the hooks of the current steps have run,
        and all of them stop before the next step, so none waits alone in a collective.
        The first reason given on this rank is kept. ``restore_best``: the final weights
        are those of the checkpoint ``output.keep_best`` kept (every rank must ask alike)."""
        if self.stop.reason is None:
            self.stop.reason, self.stop.restore_best = reason, restore_best

    @property
    def epochs(self) -> int:
        """Epochs the run will (at least partly) train: the plan's, unless max_steps ends it sooner."""
        if self.steps_per_epoch == 0:
            return self.plan.train.epochs
        return min(self.plan.train.epochs, -(-self.total_steps // self.steps_per_epoch))

    @property
    def plan(self) -> Plan:
        return self.job.plan

    @property
    def backend(self) -> str:
        return self.job.backend

    @property
    def out_dir(self) -> Path:
        return Path(self.job.out_dir)

    @property
    def options(self) -> Mapping[str, Any]:
        return self.job.options
