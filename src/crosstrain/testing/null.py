"""A backend that trains nothing, for what the loop alone does: its tests, and its own host
time per step (``benchmarks/bench_loop_floor.py``). It imports no framework."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from crosstrain.core.data import Batch, StepBatch
from crosstrain.core.strategy import FrameworkStatus, World


class LazyLoss:
    """A step's loss as a backend leaves it on its device: read by ``float()``, when the loop
    reads a chunk of steps."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value


class NullStrategy:
    """Each step's loss is its number (1, 2, ...); ``read_rows``: each step also reads its
    rows on the host, as a backend whose data is not placed does."""

    name: ClassVar[str] = "null"
    install_hint: ClassVar[str] = ""
    world = World()

    def __init__(self, read_rows: bool = False) -> None:
        self.read_rows = read_rows

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        """No framework to import: always ready (the admission step asks)."""
        return FrameworkStatus(importable=True, version="-")

    def build(self, plan: Any, weights: Mapping[str, np.ndarray]) -> dict[str, int]:
        return {}

    def train_step(self, state: Any, step: StepBatch, lr: float) -> dict[str, Any]:
        if self.read_rows:
            for micro in step.micro_batches:
                _ = micro.x, micro.y
        return {"loss": LazyLoss(float(step.step + 1))}

    def eval_step(self, state: Any, batch: Batch) -> dict[str, float]:
        return {"loss_sum": 0.0, "correct": 0.0, "count": float(batch.weight.sum())}

    def barrier(self) -> None: ...

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return values

    def state_dict(self, state: Any) -> dict[str, np.ndarray]:
        return {}
