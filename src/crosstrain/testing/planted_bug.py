"""A backend with a planted bug, for checking that ``crosstrain compare`` catches one: the
torch backend with every step's learning rate 10 % high.

Such a bug trains, converges and ends at eval metrics close to the correct backend's, so
neither a crash nor a final accuracy gives it away; what does is the per-step loss, which
departs from the reference's at step 2 (the first step after an update) by ~1e-3 relative,
where a rounding difference starts at ~1e-7. ``compare`` must call it DIFFERENT.

The module is a crosstrain plugin, loaded by name (it is no entry point, so a user's
``crosstrain backends`` never lists it)::

    crosstrain -p crosstrain.testing.planted_bug compare PLAN --backends torch,torch_lr_high --seeds 3

Importing it imports no framework: the backend is torch's, which imports torch only when
it builds or launches. torch's launcher hands the strategy's class to every worker by
reference (this module's name), and each worker loads the job's plugins, so the workers
train with the same class.
"""

from __future__ import annotations

from typing import Any, ClassVar

from crosstrain.backends.torch.state import TorchState
from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.core.data.batches import StepBatch
from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.plugins.hookspecs import hookimpl

#: the planted error: each step's learning rate times this
LEARNING_RATE_FACTOR = 1.1


class LearningRateTooHighStrategy(TorchStrategy):
    """torch, but each optimizer step uses ``LEARNING_RATE_FACTOR`` times the schedule's
    learning rate (the logged ``lr`` stays the schedule's, as a real bug's would)."""

    name: ClassVar[str] = "torch_lr_high"

    def train_step(self, state: TorchState, step: StepBatch, lr: float) -> dict[str, Any]:
        return super().train_step(state, step, lr * LEARNING_RATE_FACTOR)


@hookimpl
def crosstrain_backends() -> list[type[DistributedStrategy]]:
    return [LearningRateTooHighStrategy]
