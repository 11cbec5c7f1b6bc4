"""crosstrain: one framework-neutral training plan, run unchanged on torch DDP or tf.distribute.

Everything a plan's author, a plugin's author and a backend's author needs is exported
here; nothing outside the package should import from ``crosstrain.core``. Importing
crosstrain imports no framework.
"""

from crosstrain.api import fit
from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.errors import (
    BackendError,
    CrosstrainError,
    InputError,
    PlanError,
    PluginError,
    WorkerError,
)
from crosstrain.core.model import dropout
from crosstrain.core.model import layers as _layers
from crosstrain.core.model.graph import MODEL_INPUT, Graph, Node

# the layer types, by family: each family's __all__ names its own (a type checker reads those
# lists; core.layers.__all__, added below, comes from the classes' registry at run time)
from crosstrain.core.model.layers.activations import *  # noqa: F403
from crosstrain.core.model.layers.base import Layer as Layer
from crosstrain.core.model.layers.convolutions import *  # noqa: F403
from crosstrain.core.model.layers.dense import *  # noqa: F403
from crosstrain.core.model.layers.merges import *  # noqa: F403
from crosstrain.core.model.layers.norms import *  # noqa: F403
from crosstrain.core.model.layers.sequences import *  # noqa: F403
from crosstrain.core.model.layers.sequences import rotary_tables
from crosstrain.core.model.layers.shapes import *  # noqa: F403
from crosstrain.core.model.optimizers import DECAY_MODES, decayed_weights
from crosstrain.core.run.context import RunContext
from crosstrain.core.run.job import (
    DeviceChoice,
    Job,
    LaunchOptions,
    Layout,
    PluginSelection,
    RunResult,
    World,
)
from crosstrain.core.run.strategy import (
    ChecksJob,
    CountsMemory,
    DistributedStrategy,
    Exports,
    FindsFramework,
    FrameworkStatus,
    PlacesData,
    Predicts,
    PrefetchesBatches,
    ReduceOp,
    ReportsDevice,
    ResolvesMetrics,
    RestartsWorkers,
    RunsLocally,
    SavesOptimizerState,
    SkipsNonFiniteSteps,
    SpansNodes,
)
from crosstrain.core.run.worker import attempt_job, run_worker
from crosstrain.core.spec.data_spec import DataSpec
from crosstrain.core.spec.plan import (
    LossSpec,
    ModelSpec,
    NativeModel,
    OptimizerSpec,
    OutputSpec,
    Plan,
    ScheduleSpec,
    TrainSpec,
)
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import (
    CORE_VOCABULARY,
    SpeaksVocabulary,
    Vocabulary,
    check_plan_vocabulary,
)
from crosstrain.importers import import_keras, import_torch
from crosstrain.plugins.hookspecs import hookimpl

__all__ = [
    "CORE_VOCABULARY",
    "DECAY_MODES",
    "MODEL_INPUT",
    "BackendError",
    "Batch",
    "ChecksJob",
    "CountsMemory",
    "CrosstrainError",
    "DataSpec",
    "DeviceChoice",
    "DistributedStrategy",
    "Exports",
    "FindsFramework",
    "FrameworkStatus",
    "Graph",
    "InputError",
    "Job",
    "LaunchOptions",
    "Layout",
    "LossSpec",
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
    "Predicts",
    "PrefetchesBatches",
    "ReduceOp",
    "ReportsDevice",
    "ResolvesMetrics",
    "RestartsWorkers",
    "RunContext",
    "RunResult",
    "RunsLocally",
    "SavesOptimizerState",
    "ScheduleSpec",
    "SkipsNonFiniteSteps",
    "SpansNodes",
    "SpeaksVocabulary",
    "StepBatch",
    "TrainSpec",
    "Vocabulary",
    "WorkerError",
    "World",
    "attempt_job",
    "check_plan_vocabulary",
    "decayed_weights",
    "dropout",
    "fit",
    "hookimpl",
    "import_keras",
    "import_torch",
    "load_plan",
    "rotary_tables",
    "run_worker",
]
__all__ += _layers.__all__
__version__ = "0.1.0"
