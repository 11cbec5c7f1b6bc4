"""The run context every lifecycle hook receives."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from crosstrain.core.run.job import Job, World
from crosstrain.core.run.length import RunLength
from crosstrain.core.spec.plan import Plan


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
    def length(self) -> RunLength:
        """The run's length: its epochs and max_steps, and which ends it."""
        train = self.plan.train
        return RunLength(self.steps_per_epoch, train.epochs, train.max_steps)

    @property
    def epochs(self) -> int:
        """Epochs the run will (at least partly) train."""
        return self.length.epoch_count

    def resumed(self) -> str | None:
        """How a resumed run continues, for its header: ``resumed at step 20 as run``, or
        what its layout was where it changed (``resumed at step 20 (was torch x2)``); None
        for a run from step 0."""
        if self.start_step == 0:
            return None
        job, said = self.job, f"resumed at step {self.start_step}"
        if job.resumed_layout is not None:
            was = job.layout.differences(job.resumed_layout)
            return f"{said} (was {', '.join(was)})" if was else f"{said} as run"
        if job.resume_from is not None:  # --resume of a folder written before launch.json
            return f"{said} (its folder records no layout: the flags and defaults apply)"
        return said  # a worker group restarted after a failure

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
        return self.job.launch.options
