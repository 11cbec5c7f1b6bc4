"""Helpers for tests: crosstrain.testing's readers of what a real run wrote, in one place,
the scaled-image batches both backends' feed tests read, and a recorder of the loop's
step losses."""

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crosstrain.core.data.batches import Batch, Datasets
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing import assert_same_eval, max_relative_difference, step_losses, summary
from crosstrain.testing.data_plans import write_images

__all__ = [
    "StepRecorder",
    "assert_same_eval",
    "max_relative_difference",
    "scaled_images_on_the_host",
    "step_losses",
    "summary",
]


def scaled_images_on_the_host(plan_file: Path) -> tuple[Plan, Datasets, list[Batch]]:
    """The plan at ``plan_file`` (SCALED_IMAGES_PLAN) with its uint8 images written beside it
    and kept on the host, its data sets, and a batch of rows 3, 0, 3 and the last of each."""
    write_images(str(plan_file.parent))
    plan = load_plan(plan_file, ["data.placement='host'"])
    datasets = load_datasets(plan)
    parts = [part for part in (datasets.train, datasets.eval) if part is not None]
    batches = [
        Batch.of_rows(part, np.array([3, 0, 3, len(part) - 1]), np.ones(4, np.float32), np.arange(4))
        for part in parts
    ]
    return plan, datasets, batches


class StepRecorder:
    """The loop's hooks, passed to ``train`` as its relay: every step's (step, loss); with
    ``stop_at``, asks the loop to stop after that step. Every other hook does nothing."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.steps: list[tuple[int, float]] = []
        self.stop_at = stop_at

    @property
    def losses(self) -> list[float]:
        return [loss for _, loss in self.steps]

    def crosstrain_step_end(
        self, context: Any, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
    ) -> None:
        self.steps.append((step, metrics["loss"]))
        if step == self.stop_at:
            context.request_stop("enough")

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda **kwargs: None
