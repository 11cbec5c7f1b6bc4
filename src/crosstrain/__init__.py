"""crosstrain: one framework-neutral training plan, run unchanged on torch DDP or tf.distribute.

Everything a plan's author, a plugin's author and a backend's author needs is exported
here; nothing outside the package should import from ``crosstrain.core``. Importing
crosstrain imports no framework.
"""

from crosstrain.api import fit
from crosstrain.core import dropout
from crosstrain.core.context import RunContext
from crosstrain.core.data import Batch, StepBatch
from crosstrain.core.errors import (
    BackendError,
    CrosstrainError,
    InputError,
    PlanError,
    WorkerError,
)
from crosstrain.core.graph import MODEL_INPUT, Graph, Node
from crosstrain.core.layers import (
    GELU,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Block,
    Concat,
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    Layer,
    LayerNorm,
    MaxPool2D,
    PositionEmbedding,
    ReLU,
    Tanh,
)
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
from crosstrain.core.strategy import (
    ChecksJob,
    DeviceChoice,
    DistributedStrategy,
    FrameworkStatus,
    Job,
    PlacesData,
    PluginSelection,
    PrefetchesBatches,
    ReduceOp,
    ReportsDevice,
    ResolvesMetrics,
    RestartsWorkers,
    RunResult,
    SavesOptimizerState,
    SkipsNonFiniteSteps,
    World,
)
from crosstrain.core.vocabulary import SpeaksVocabulary, Vocabulary, check_plan_vocabulary
from crosstrain.core.worker import run_worker
from crosstrain.plugins.hookspecs import hookimpl
from crosstrain.plugins.manager import PluginError

__all__ = [
    "GELU",
    "MODEL_INPUT",
    "Add",
    "Attention",
    "AvgPool2D",
    "BackendError",
    "Batch",
    "BatchNorm",
    "Block",
    "ChecksJob",
    "Concat",
    "Conv2D",
    "CrosstrainError",
    "DataSpec",
    "Dense",
    "DeviceChoice",
    "DistributedStrategy",
    "Dropout",
    "Embedding",
    "Flatten",
    "FrameworkStatus",
    "GlobalAvgPool2D",
    "Graph",
    "InputError",
    "Job",
    "Layer",
    "LayerNorm",
    "LossSpec",
    "MaxPool2D",
    "ModelSpec",
    "NativeModel",
    "Node",
    "OptimizerSpec",
    "OutputSpec",
    "PlacesData",
    "Plan",
    "PlanError",
    "PluginError",
    "PluginSelection",
    "PositionEmbedding",
    "PrefetchesBatches",
    "ReLU",
    "ReduceOp",
    "ReportsDevice",
    "ResolvesMetrics",
    "RestartsWorkers",
    "RunContext",
    "RunResult",
    "SavesOptimizerState",
    "ScheduleSpec",
    "SkipsNonFiniteSteps",
    "SpeaksVocabulary",
    "StepBatch",
    "Tanh",
    "TrainSpec",
    "Vocabulary",
    "WorkerError",
    "World",
    "check_plan_vocabulary",
    "dropout",
    "fit",
    "hookimpl",
    "load_plan",
    "run_worker",
]
__version__ = "0.1.0"
