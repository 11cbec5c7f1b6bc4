from __future__ import annotations

import math

import pytest

from crosstrain.core.run.schedule import LearningRateSchedule
from crosstrain.core.spec.plan import ScheduleSpec


def test_linear_warmup_then_constant() -> None:
    schedule = LearningRateSchedule(0.1, ScheduleSpec(name="constant", warmup_steps=4), 100)
    assert [schedule(s) for s in range(5)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])


def test_step_decay() -> None:
    schedule = LearningRateSchedule(1.0, ScheduleSpec(name="step", step_size=10, gamma=0.5), 100)
    assert (schedule(0), schedule(9), schedule(10), schedule(25)) == (1.0, 1.0, 0.5, 0.25)


def test_cosine_reaches_min_lr_at_the_end() -> None:
    schedule = LearningRateSchedule(1.0, ScheduleSpec(name="cosine", warmup_steps=10, min_lr=0.1), 110)
    assert schedule(10) == 1.0
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(110) == pytest.approx(0.1)
