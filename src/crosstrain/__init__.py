"""crosstrain: one framework-neutral training plan, run unchanged on torch DDP or tf.distribute.

Importing crosstrain imports no framework.
"""

from crosstrain.api import fit
from crosstrain.core.errors import BackendError, CrosstrainError, PlanError, WorkerError
from crosstrain.core.plan import (
    DataSpec,
    LossSpec,
    ModelSpec,
    NativeModel,
    OptimizerSpec,
    OutputSpec,
    Plan,
    ScheduleSpec,
    TrainSpec,
    load_plan,
)
from crosstrain.core.strategy import DistributedStrategy, Job, RunResult, World
from crosstrain.plugins.hookspecs import hookimpl

__all__ = [
    "BackendError",
    "CrosstrainError",
    "DataSpec",
    "DistributedStrategy",
    "Job",
    "LossSpec",
    "ModelSpec",
    "NativeModel",
    "OptimizerSpec",
    "OutputSpec",
    "Plan",
    "PlanError",
    "RunResult",
    "ScheduleSpec",
    "TrainSpec",
    "WorkerError",
    "World",
    "fit",
    "hookimpl",
    "load_plan",
]
__version__ = "0.1.0"
