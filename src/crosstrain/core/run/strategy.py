"""What a backend does: the DistributedStrategy protocol, and the values it exchanges with core.

The loop in :mod:`crosstrain.core.run.loop` calls only this protocol. A backend is a
class registered through the ``crosstrain`` entry-point group (see
:mod:`crosstrain.plugins.hookspecs`); nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import attrs
import numpy as np

from crosstrain.core.data.batches import Batch, Datasets, StepBatch
from crosstrain.core.run.job import Job, RunResult, World
from crosstrain.core.spec.plan import Plan

ReduceOp = Literal["sum", "mean", "max", "min"]


@attrs.frozen
class FrameworkStatus:
    """For ``crosstrain backends``: does the framework import, and what does it see."""

    importable: bool
    version: str = ""
    devices: tuple[str, ...] = ()
    problem: str = ""


@runtime_checkable
class FindsFramework(Protocol):
    """Optional capability: tell whether the framework is installed without importing it.
    Admission asks in the launching process, which for a backend whose workers are fresh
    processes never needs the framework itself: importing TensorFlow there only to check
    that it imports cost every run seconds of CPU before its workers started theirs.
    Without it, admission asks :meth:`DistributedStrategy.framework_status`."""

    @classmethod
    def framework_installed(cls) -> FrameworkStatus:
        """Whether the framework's package is installed (found, not imported); never raises."""
        ...


@runtime_checkable
class ChecksJob(Protocol):
    """Optional capability: refuse a layout the backend cannot run (processes, devices)
    before the output folder is created or any process starts."""

    def check_job(self, job: Job) -> None:
        """Raise :class:`~crosstrain.core.errors.BackendError` naming what does not fit."""
        ...


@runtime_checkable
class PlacesData(Protocol):
    """Optional capability: keep the data sets where the backend computes. The loop calls
    it once after ``build``; the batches it then hands over carry row indices
    (``Batch.source``), which the backend gathers where it placed the data. Without it, a
    backend reads ``batch.x``/``batch.y``: rows gathered on the host."""

    def place_data(self, state: Any, datasets: Datasets) -> None:
        """Place (or decide not to place) the data per ``plan.data.placement``."""
        ...


@runtime_checkable
class ResolvesMetrics(Protocol):
    """Optional capability: ``train_step`` returns metric values that stay on the device
    (no host sync per step); the loop reads a chunk of steps' values at once through this.
    Without it, the loop reads each value with ``float()``."""

    def resolve_metrics(self, pending: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        """The steps' metrics as floats, in order, read with as few device syncs as it can."""
        ...


#: steps the loop names to a backend ahead of the one it runs (an epoch's first step with
#: the ones after it): a backend can have them all in flight at once (the image decoders'
#: pool works on the next two batches while a step computes: one batch at a time, each
#: batch's slowest chunk left the other workers idle)
PREFETCH_STEPS = 2


@runtime_checkable
class PrefetchesBatches(Protocol):
    """Optional capability: the loop names each step's batch before the steps ahead of it
    run (``PREFETCH_STEPS`` ahead, in order), so the backend can read its rows and copy them
    to the device meanwhile (a background thread and a side stream); ``train_step`` then
    finds them there."""

    def prefetch(self, state: Any, step: StepBatch) -> None:
        """Start bringing ``step``'s rows to the device; returns at once."""
        ...


@runtime_checkable
class SavesOptimizerState(Protocol):
    """Optional capability, needed by ``output.checkpoint_every_steps`` and ``--resume``:
    the optimizer's state as numpy under neutral names, the same on every backend.

    Slot tensors are named ``optimizer.{weight name}.{slot}`` in the weight's neutral
    layout, with ``slot`` one of :data:`OPTIMIZER_SLOTS` (sgd: ``momentum``; adam, adamw:
    ``exp_avg``, ``exp_avg_sq``). Scalars are 0-d arrays: ``optimizer.step`` (optimizer
    steps applied, which Adam's bias corrections count) and, with a dynamic loss scale,
    ``loss_scale.scale`` and ``loss_scale.growth_tracker`` (finite steps since it last changed).
    ``state_dict`` may gather across ranks, and so may this: every rank calls it."""

    def optimizer_state(self, state: Any) -> Mapping[str, np.ndarray]:
        """The optimizer's slots and scalars under the neutral names above (a sharded
        backend's: :class:`~crosstrain.core.run.checkpoint.StreamedTensors`, each slot
        gathered as it is read; its scalars read without a collective)."""
        ...

    def load_optimizer_state(self, state: Any, tensors: Mapping[str, np.ndarray]) -> None:
        """Load what :meth:`optimizer_state` returned, possibly on another backend."""
        ...


@runtime_checkable
class SkipsNonFiniteSteps(Protocol):
    """Optional capability, needed by ``train.on_nonfinite = "skip"``: ``train_step`` checks
    the step's gradients on the device and, when one is NaN or infinite, applies no update
    (weights, slots and the optimizer's step count stay as they were)."""

    def skips_nonfinite_steps(self) -> bool:
        """True: the plan's ``train.on_nonfinite = "skip"`` is honoured by ``train_step``."""
        ...


@runtime_checkable
class CountsMemory(Protocol):
    """Optional capability: the bytes this process holds of the model's training state,
    counted from the tensors themselves (a sharded tensor: its local shard), for
    summary.json's ``memory_per_rank`` (:data:`~crosstrain.core.run.rank_usage.MEMORY_PARTS`),
    asked once, after the last step, on every rank."""

    def memory_held(self, state: Any) -> dict[str, int]:
        """``parameters``, ``gradients`` (one for each trainable parameter's shard, in its
        dtype: they are freed between steps) and ``optimizer`` (every slot and count), in bytes."""
        ...


@runtime_checkable
class ReportsDevice(Protocol):
    """Optional capability: facts about this process's device for summary.json's ``ranks``
    (see :mod:`crosstrain.core.run.rank_usage`), asked once, after the last step."""

    def device_report(self, state: Any) -> dict[str, float | None]:
        """``peak_device_memory_bytes`` and ``gpu_utilisation_percent`` (mean while
        training), each None where it cannot be measured."""
        ...


@runtime_checkable
class SpansNodes(Protocol):
    """Optional capability, needed by ``--nnodes`` > 1 and by an outside launcher's group
    (torchrun, SLURM, Kubeflow, TF_CONFIG) of more than one process: ``launch`` honours
    ``job.nnodes``, ``job.launch.node_rank``/``rdzv_endpoint`` and joins the detected environment
    (:mod:`crosstrain.launch.environments`). Without it the backend runs on one machine."""

    def spans_nodes(self) -> bool:
        """True: ``launch`` runs across machines and under outside launchers."""
        ...


@runtime_checkable
class RestartsWorkers(Protocol):
    """Optional capability, needed by ``--max-restarts``: ``launch`` restarts the whole
    worker group after a failure, up to ``job.launch.max_restarts`` times, and each restarted
    worker runs :func:`crosstrain.core.run.worker.attempt_job` (it resumes)."""

    def restarts_workers(self) -> bool:
        """True: ``job.launch.max_restarts`` is honoured by ``launch``."""
        ...


@runtime_checkable
class Predicts(Protocol):
    """Optional capability, needed by ``crosstrain predict`` and ``crosstrain export``: the
    model's outputs for some rows, in inference mode (dropout off, batch norm's moving
    statistics), in this process (world 1). Every backend of the conformance suite has it."""

    def predict(self, state: Any, x: np.ndarray) -> np.ndarray:
        """Float32 outputs (logits) for ``x``: rows of ``model.input_shape``, already scaled
        as the plan asks (float32; int32 token ids for an ``int32`` model)."""
        ...


@runtime_checkable
class RunsLocally(Protocol):
    """Optional capability, needed by ``crosstrain evaluate/predict --device``: a strategy of
    world 1 in this process on the CPU or the first GPU (without it: the backend's
    default construction, on the CPU only)."""

    @classmethod
    def local(cls, device: Literal["cpu", "gpu"]) -> DistributedStrategy:
        """A world-1 strategy on ``device``; raises
        :class:`~crosstrain.core.errors.BackendError` when there is no such device."""
        ...


@runtime_checkable
class Exports(Protocol):
    """Optional capability, needed by ``crosstrain export``: write a trained model as files
    its framework loads without crosstrain."""

    def export_formats(self) -> tuple[str, ...]:
        """The ``--format`` names this backend writes (e.g. ``("torch",)``)."""
        ...

    def export(self, state: Any, format_name: str, out: Path, sample: np.ndarray) -> list[Path]:
        """Write ``state``'s model in ``format_name`` under ``out`` (a folder) and return the
        files written. What is written takes raw rows, as ``crosstrain predict`` does: it
        applies the plan's input scaling (``plan.data.scaling``) before the model.
        ``sample`` is a few such raw rows: the export checks that what it wrote computes
        :meth:`Predicts.predict`'s outputs on them scaled."""
        ...


@runtime_checkable
class DistributedStrategy(Protocol):
    """One backend. Core builds the weights and batches and computes the learning rate;
    the backend turns them into native models, steps and collectives."""

    name: ClassVar[str]
    #: what installs this backend's framework, quoted when it is missing
    #: (e.g. "pip install 'crosstrain[torch]'" or, for a third party, "pip install jax")
    install_hint: ClassVar[str]
    world: World

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        """Whether the framework imports, its version and devices; never raises."""
        ...

    def launch(self, job: Job) -> RunResult:
        """Create the replicas (processes or devices), run :func:`core.loop.fit` in each,
        and return rank 0's summary. A failure anywhere ends the whole job and raises
        :class:`~crosstrain.core.errors.WorkerError` with the failing rank's traceback."""
        ...

    def build(self, plan: Plan, weights: Mapping[str, np.ndarray]) -> Any:
        """Native model and optimizer from crosstrain's initial weights (neutral names)."""
        ...

    def train_step(self, state: Any, step: StepBatch, lr: float) -> Mapping[str, Any]:
        """Forward, loss / ``step.global_real_targets``, backward over every micro-batch,
        gradient sum across replicas, clipping, one optimizer step at ``lr``.
        Returns global metrics (``loss``: the mean loss over real targets of the step), as
        floats or as device scalars that ``float()`` (or :class:`ResolvesMetrics`) reads later."""
        ...

    def eval_step(self, state: Any, batch: Batch) -> dict[str, float]:
        """Metric sums over the real rows of the whole global batch (all replicas):
        ``loss_sum``, ``count``, and for each metric of the plan the backend counts,
        ``correct`` (``accuracy``) and ``top_k_correct`` (``top_k_accuracy``)."""
        ...

    def all_reduce(self, values: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        """Reduce a small host array across processes; every process gets the result."""
        ...

    def broadcast(self, values: np.ndarray, src: int = 0) -> np.ndarray:
        """Process ``src``'s array, on every process."""
        ...

    def barrier(self) -> None:
        """Wait for every process, with the job's timeout."""
        ...

    def state_dict(self, state: Any) -> Mapping[str, np.ndarray]:
        """Weights as numpy under neutral names and channels-last layouts (a dict; or, from
        a backend that shards its weights, :class:`~crosstrain.core.run.checkpoint.StreamedTensors`,
        which gathers each weight as it is read: every rank reads them, in order)."""
        ...

    def load_state_dict(self, state: Any, tensors: Mapping[str, np.ndarray]) -> None:
        """Load weights given under neutral names and layouts."""
        ...
