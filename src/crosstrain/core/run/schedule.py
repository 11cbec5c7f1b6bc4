"""Learning rate per optimizer step, computed by core (never by a framework) and handed to train_step."""

from __future__ import annotations

import math

import attrs

from crosstrain.core.spec.plan import ScheduleSpec


@attrs.frozen
class LearningRateSchedule:
    base_lr: float
    spec: ScheduleSpec
    total_steps: int

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        warmup = self.spec.warmup_steps
        if step < warmup:
            return self.base_lr * (step + 1) / warmup
        after_warmup = step - warmup
        if self.spec.name == "step":
            return self.base_lr * self.spec.gamma ** (after_warmup // self.spec.step_size)
        if self.spec.name == "exponential":
            return self.base_lr * self.spec.gamma**after_warmup
        if self.spec.name == "cosine":
            span = max(1, self.total_steps - warmup)
            progress = min(1.0, after_warmup / span)
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            return self.spec.min_lr + (self.base_lr - self.spec.min_lr) * cosine
        return self.base_lr
