"""What a backend does: the DistributedStrategy protocol, and the values it exchanges with core.

The loop in :mod:`crosstrain.core.run.loop` calls only this protocol. A backend is a
class registered through the ``crosstrain`` entry-point group (see
:mod:`crosstrain.plugins.hookspecs`); nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import attrs
import numpy as np
import pluggy

from crosstrain.core.data.batches import Batch, Datasets, StepBatch
from crosstrain.core.spec.plan import Plan

DeviceChoice = Literal["auto", "cpu", "gpu"]
ReduceOp = Literal["sum", "mean", "max", "min"]


@attrs.frozen
class World:
    """Where this process stands. A replica is one model copy; a process holds one
    (torch DDP) or several (tf MirroredStrategy) of them."""

    process_index: int = 0
    process_count: int = 1
    local_replicas: int = 1
    device: str = "cpu"

    @property
    def replicas(self) -> int:
        return self.process_count * self.local_replicas

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    @property
    def rank(self) -> int:
        return self.process_index


@attrs.frozen
class PluginSelection:
    """Which plugins a process loads: the same rules in the CLI and in every worker."""

    autoload: bool = True
    enabled: tuple[str, ...] = ()
    disabled: tuple[str, ...] = ()


#: turns a process's plugin selection into the hook relay the loop calls; the plugin
#: manager's :func:`crosstrain.plugins.manager.hook_relay` (core sits below the manager)
HookLoader = Callable[[PluginSelection], pluggy.HookRelay]


@attrs.frozen
class Layout:
    """Where a run's replicas run: what ``--backend``, ``--nproc``, ``--workers``,
    ``--nnodes`` and ``--device`` chose (``replicas`` as resolved; ``workers`` None: the
    backend's natural layout). A run folder records it at each launch, and a bare
    ``--resume`` continues on it."""

    backend: str
    replicas: int
    workers: int | None = None
    nnodes: int = 1
    device: DeviceChoice = "auto"

    def differences(self, before: Layout) -> list[str]:
        """What ``before`` had where this layout differs, as the flags name it
        (``torch x2``, ``--workers 2``, ``--nnodes 2``, ``--device gpu``); [] if the same."""
        was = []
        if (self.backend, self.replicas) != (before.backend, before.replicas):
            was.append(f"{before.backend} x{before.replicas}")
        if self.workers != before.workers:
            was.append(f"--workers {before.workers}" if before.workers is not None else "--workers unset")
        if self.nnodes != before.nnodes:
            was.append(f"--nnodes {before.nnodes}")
        if self.device != before.device:
            was.append(f"--device {before.device}")
        return was


@attrs.frozen
class Job:
    """Everything a worker needs to run the plan; picklable, sent to every process.

    ``replicas`` is the total number of model copies (``--nproc``); ``workers`` the number
    of processes (``--workers``), None letting the backend choose its natural layout.
    """

    plan: Plan
    backend: str
    replicas: int = 1
    workers: int | None = None
    device: DeviceChoice = "auto"
    out_dir: str = "runs/latest"
    options: Mapping[str, Any] = attrs.field(factory=dict)
    plugins: PluginSelection = PluginSelection()
    timeout_seconds: float = 300.0
    #: continue from the run folder's last complete checkpoint (from the start when it has
    #: none: a worker group restarted before its first checkpoint). The CLI's ``--resume``
    #: sets it; a launcher that restarts its workers sets it on the restarted ones.
    resume: bool = False
    #: the checkpoint folder a resumed run continues from, chosen and verified before launch
    #: (the newest intact one: :func:`crosstrain.core.admission.checks.admit` sets it), so every
    #: worker reads that one rather than searching again; None: the workers search (a
    #: restarted group continues from the newest checkpoint it wrote itself)
    resume_from: str | None = None
    #: a new run starts from these weights (a safetensors file under neutral names, checked
    #: against the plan's model before launch: ``--init-from``); the optimizer starts fresh
    #: at step 0, and the run evaluates the weights before its first step
    init_from: str | None = None
    #: how many times a launcher that can restart its workers (torch's elastic agent)
    #: restarts the whole group after a failure; each restart resumes
    max_restarts: int = 0
    #: machines crosstrain launches on (``--nnodes``), this one's index (``--node-rank``)
    #: and where they meet (``--rdzv-endpoint HOST:PORT``, node 0's); ``replicas`` counts
    #: the replicas on all of them
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    #: a table run's statistics as the admission computed them from its training rows (their
    #: JSON), which the run folder keeps: the table is read once before launch, not twice
    table_statistics: Mapping[str, Any] | None = None
    #: a run continued by ``--resume``: the layout its run folder recorded at its last launch
    #: (for the header line, which says whether it continues as it ran); None: a new run, or a
    #: folder written before runs recorded their layout
    resumed_layout: Layout | None = None
    #: how each worker loads ``plugins`` (:func:`crosstrain.core.run.worker.run_worker` calls it):
    #: set by ``crosstrain.api.make_job`` to the plugin manager's ``hook_relay``. Core may not
    #: import the manager, so whoever makes the job hands it down; a module-level function,
    #: so the job still pickles (by reference) to every process
    load_hooks: HookLoader | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.backend, self.replicas, self.workers, self.nnodes, self.device)


@attrs.frozen
class RunResult:
    """What launch returns: rank 0's summary (the same dict written to summary.json)."""

    summary: Mapping[str, Any]
    out_dir: str


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

    def optimizer_state(self, state: Any) -> dict[str, np.ndarray]:
        """The optimizer's slots and scalars under the neutral names above."""
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
    ``job.nnodes``/``node_rank``/``rdzv_endpoint`` and joins the detected environment
    (:mod:`crosstrain.launch.environments`). Without it the backend runs on one machine."""

    def spans_nodes(self) -> bool:
        """True: ``launch`` runs across machines and under outside launchers."""
        ...


@runtime_checkable
class RestartsWorkers(Protocol):
    """Optional capability, needed by ``--max-restarts``: ``launch`` restarts the whole
    worker group after a failure, up to ``job.max_restarts`` times, and each restarted
    worker runs :func:`crosstrain.core.run.worker.attempt_job` (it resumes)."""

    def restarts_workers(self) -> bool:
        """True: ``job.max_restarts`` is honoured by ``launch``."""
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

    def state_dict(self, state: Any) -> dict[str, np.ndarray]:
        """Weights as numpy under neutral names and channels-last layouts."""
        ...

    def load_state_dict(self, state: Any, tensors: Mapping[str, np.ndarray]) -> None:
        """Load weights given under neutral names and layouts."""
        ...
