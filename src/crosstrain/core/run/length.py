"""How long a run trains: ``train.epochs`` and ``train.max_steps`` over an epoch's steps.

``max_steps`` without ``epochs`` runs exactly that many steps, through as many epochs as
it takes (Lightning's ``max_steps``); ``epochs`` without ``max_steps`` runs whole epochs;
with both, the earlier end wins; with neither, one epoch.
"""

from __future__ import annotations

import math

import attrs

from crosstrain.core.data.batches import GlobalSampler
from crosstrain.core.spec.plan import Plan

EPOCHS, MAX_STEPS = "train.epochs", "train.max_steps"


@attrs.frozen
class RunLength:
    steps_per_epoch: int
    #: as the plan states them (None: unset)
    epochs: int | None = None
    max_steps: int | None = None

    @classmethod
    def of(cls, plan: Plan, train_rows: int) -> RunLength:
        per_epoch = GlobalSampler(train_rows, plan.train.global_batch_size, plan.seed).steps_per_epoch
        return cls(per_epoch, plan.train.epochs, plan.train.max_steps)

    @property
    def epochs_end(self) -> int | None:
        """The step the epochs end at; None: unbounded (``max_steps`` without ``epochs``)."""
        if self.epochs is None:
            return None if self.max_steps is not None else self.steps_per_epoch
        return self.epochs * self.steps_per_epoch

    @property
    def total_steps(self) -> int:
        """Optimizer steps in the run."""
        if self.steps_per_epoch == 0:
            return 0
        return min(end for end in (self.epochs_end, self.max_steps) if end is not None)

    @property
    def epoch_count(self) -> int:
        """Epochs the run (at least partly) trains."""
        return max(1, -(-self.total_steps // max(self.steps_per_epoch, 1)))

    def ending_fields(self) -> list[str]:
        """The fields whose end is the run's (both when they end at the same step; none when
        neither is set: one epoch)."""
        total = self.total_steps
        fields = [EPOCHS] if self.epochs is not None and self.epochs_end == total else []
        return fields + ([MAX_STEPS] if self.max_steps == total else [])

    def describe(self) -> str:
        """``150 steps (max_steps; 2.4 epochs)``, ``63 steps (1 epoch; max_steps 150 not
        reached)``, ``46 steps (2 epochs)``."""
        total, epochs = self.total_steps, self._epochs_run()
        if self.max_steps is not None and self.ending_fields() == [MAX_STEPS]:
            return f"{_steps(total)} (max_steps; {epochs})"
        if self.max_steps is not None and self.max_steps > total:
            return f"{_steps(total)} ({epochs}; max_steps {self.max_steps} not reached)"
        return f"{_steps(total)} ({epochs})"

    def extension_hint(self) -> str:
        """What continues a run that ended: every field that ends it raised (either, when
        neither is set)."""
        fields = self.ending_fields()
        if not fields:
            return f"--set {EPOCHS}=N or {MAX_STEPS}=N continues it to a new end"
        if len(fields) == 1:
            return f"--set {fields[0]}=N continues it to a new end"
        return f"--set {EPOCHS}=N and {MAX_STEPS}=M continue it to a new end (each ends it now)"

    def reason(self) -> str:
        """What ends the run where it ends: ``train.max_steps = 126``, ``train.epochs = 2``,
        or one epoch when neither is set."""
        shown = {EPOCHS: self.epochs, MAX_STEPS: self.max_steps}
        fields = self.ending_fields()
        if not fields:
            return "one epoch: train.epochs and train.max_steps unset"
        return " and ".join(f"{field} = {shown[field]}" for field in fields)

    def epochs_needed(self, steps: int) -> int:
        """The fewest epochs that reach ``steps``."""
        return math.ceil(steps / max(self.steps_per_epoch, 1))

    def _epochs_run(self) -> str:
        per_epoch = max(self.steps_per_epoch, 1)
        if self.total_steps % per_epoch == 0:
            whole = self.total_steps // per_epoch
            return "1 epoch" if whole == 1 else f"{whole} epochs"
        fraction = self.total_steps / per_epoch
        shown = f"{fraction:.1f}"
        return f"{shown if shown != '0.0' else f'{fraction:.1g}'} epochs"


def _steps(count: int) -> str:
    return "1 step" if count == 1 else f"{count} steps"
