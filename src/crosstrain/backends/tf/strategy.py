"""TfStrategy: tf.distribute's MirroredStrategy (several replicas in one process) or
MultiWorkerMirroredStrategy (one process per worker), driven by a custom loop.

The optimizer (torch's semantics, in TensorFlow ops) lives in optimizer.py.

This module imports tensorflow only inside functions, so ``crosstrain backends`` can
list the backend (and say tensorflow is missing) on a machine without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import numpy as np

from crosstrain.backends.tf.feed import TfFeed, host_inputs
from crosstrain.backends.tf.optimizer import DynamicLossScale, make_slots, slot_count, step_scalars
from crosstrain.backends.tf.runtime import import_tensorflow
from crosstrain.backends.tf.steps import (
    Fetch,
    eval_function,
    eval_names,
    guarded_steps,
    host_rows,
    pack_step,
    placed_rows,
    predict_function,
    train_function,
)
from crosstrain.backends.tf.zero import ShardedSlots, make_sharded_slots
from crosstrain.core.data.batches import Batch, Datasets, StepBatch
from crosstrain.core.errors import BackendError, PlanError
from crosstrain.core.model.optimizers import DECAY_MODES, OPTIMIZER_SLOTS
from crosstrain.core.run.job import Job, RunResult, World
from crosstrain.core.run.rank_usage import GpuUtilisation
from crosstrain.core.run.strategy import FrameworkStatus, ReduceOp
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, Vocabulary

#: the ``train.shard`` modes beyond "none" that tf trains (:mod:`crosstrain.backends.tf.zero`)
SHARD_MODES = ("optimizer",)
#: the ``train.shard`` modes tf does not train, and why (its vocabulary's refusal line)
UNSHARDED = {
    "full": "tf.distribute shards no parameters (Mirrored and MultiWorkerMirrored replicate "
    "every variable; DTensor is deprecated and Keras 3's ModelParallel has no TensorFlow "
    "side); train with 'none' or 'optimizer', or shard 'full' on torch and resume here "
    "unsharded",
}

if TYPE_CHECKING:
    import keras


@attrs.define
class TfState:
    model: keras.Model
    plan: Plan
    variables: list[Any]  # what the optimizer updates: the trainable weights' variables
    slots: list[tuple[Any, ...]]  # optimizer state per trainable variable, mirrored like it
    feed: TfFeed  # the data sets placed on the replicas' devices, if they are
    # tf.function: (inputs, integers, floats) -> (loss, finite); the inputs (xs, ys) rows
    # from the host with a leading micro-batch axis, the rest as steps.pack_step packs them
    train_function: Any
    eval_function: Any  # tf.function: ((x, y), weight, rows) -> float64 sums named by eval_names
    optimizer_steps: int = 0  # steps applied so far: Adam's bias corrections count these
    loss_scale: DynamicLossScale | None = None
    predict_function: Any = None  # tf.function: x -> outputs, made by the first predict()
    #: ("train" | "eval", id(data set)) -> the function taking (indices,) of placed rows;
    #: ("train" | "eval", (dtype, scaling)) -> the function taking (xs, ys) of host rows as
    #: stored, which it casts to dtype and scales; ("train", ("per replica", dtype, scaling))
    #: -> the same, taking each replica's rows already on its device (read ahead)
    functions: dict[tuple[str, Any], Any] = attrs.field(factory=dict)
    utilisation: GpuUtilisation | None = None  # sampled while training on a GPU
    #: under train.shard = "optimizer": the slots, each replica holding its run (``slots`` empty)
    sharded: ShardedSlots | None = None


class TfStrategy:
    name: ClassVar[str] = "tf"
    install_hint: ClassVar[str] = "pip install 'crosstrain[tf]' (no GPU: 'crosstrain[tf-cpu]')"

    def __init__(
        self, world: World | None = None, distribution: Any = None, prefetch: bool | None = None
    ) -> None:
        self.world = world or World()
        self._distribution = distribution  # a tf.distribute.Strategy; None: TF's default
        self._gather_function: Any = None
        # whether the next step's host rows are copied to the replicas' devices ahead;
        # None: on GPUs (on a CPU there is no copy to overlap)
        self._prefetch = prefetch

    @property
    def distribution(self) -> Any:
        if self._distribution is None:
            import tensorflow as tf

            self._distribution = tf.distribute.get_strategy()
        return self._distribution

    @classmethod
    def local(cls, device: Literal["cpu", "gpu"]) -> TfStrategy:
        """World 1 in this process: one replica on the CPU or on the first GPU."""
        tf = import_tensorflow()
        if device == "gpu" and not tf.config.list_physical_devices("GPU"):
            raise BackendError("--device gpu: tensorflow sees no GPU")
        name = "/gpu:0" if device == "gpu" else "/cpu:0"
        return cls(World(device=name.lstrip("/")), tf.distribute.OneDeviceStrategy(name))

    # ----------------------------------------------------------------- discovery and launch

    @classmethod
    def framework_installed(cls) -> FrameworkStatus:
        """Found, not imported: the launching process never runs TensorFlow (its workers do,
        and a broken install fails there, naming the rank)."""
        if importlib.util.find_spec("tensorflow") is None:
            return FrameworkStatus(importable=False, problem="No module named 'tensorflow'")
        return FrameworkStatus(importable=True)

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        if not (installed := cls.framework_installed()).importable:
            return installed
        try:
            tf = import_tensorflow()
            # Physical devices only: the runtime stays uninitialised, so logical devices
            # can still be configured (in the workers, which is where training runs).
            gpus = tf.config.list_physical_devices("GPU")
        except Exception as error:  # a broken install must not break `crosstrain backends`
            return FrameworkStatus(importable=False, problem=f"{type(error).__name__}: {error}")
        devices = ("cpu", *(f"gpu:{index}" for index in range(len(gpus))))
        return FrameworkStatus(importable=True, version=str(tf.__version__), devices=devices)

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        """Every name core defines: the tf backend builds them all. Declared rather than
        read off the tables, whose module imports TensorFlow (seconds of CPU) in the
        launching process, which checks the plan but never runs a step;
        ``tests/tf/test_layers.py`` holds this to :func:`table_vocabulary`."""
        return attrs.evolve(
            CORE_VOCABULARY,
            shard=frozenset({"none", *SHARD_MODES}),
            unsharded=tuple(sorted(UNSHARDED.items())),
        )

    def check_job(self, job: Job) -> None:
        from crosstrain.backends.tf.launch import cluster_from_environment, physical_gpus, plan_layout

        plan_layout(job, cluster_from_environment(), physical_gpus() if job.device != "cpu" else 0)
        check_compilable(job.plan)

    def spans_nodes(self) -> bool:
        """--nnodes and outside launchers (torchrun, SLURM, Kubeflow, TF_CONFIG): see launch.py."""
        return True

    def launch(self, job: Job) -> RunResult:
        from crosstrain.backends.tf.launch import launch

        return launch(job, type(self))

    # ----------------------------------------------------------------- model

    def build(self, plan: Plan, weights: Mapping[str, np.ndarray]) -> TfState:
        from crosstrain.backends.tf.model import build_model, load_neutral

        with self.distribution.scope():
            model = build_model(plan)
            if weights:
                load_neutral(model, plan, weights)
            # the optimizer's variables: batch norm's moving statistics are not among them
            variables = [variable.value for variable in model.trainable_variables]
        sharded = None
        if plan.train.shard == "optimizer":
            sharded = make_sharded_slots(self.distribution, slot_count(plan.optimizer), variables)
            slots = []
        else:
            with self.distribution.scope():
                slots = make_slots(plan.optimizer, variables)
        loss_scale = DynamicLossScale() if plan.train.precision == "fp16" else None
        fetch = host_rows(self.world.local_replicas)
        utilisation = None
        if self._on_gpu():
            from crosstrain.backends.tf.gpu import reset_peak_memory, sample_utilisation

            reset_peak_memory()
            utilisation = sample_utilisation()
        return TfState(
            model,
            plan,
            variables,
            slots,
            TfFeed(
                self.distribution,
                "gpu" if self._on_gpu() else "cpu",
                self.world.local_replicas,
                self._prefetch,
            ),
            train_function(
                self.distribution, self.world.local_replicas, model, variables, slots, plan, fetch, sharded
            ),
            eval_function(self.distribution, self.world.local_replicas, model, plan, fetch),
            loss_scale=loss_scale,
            utilisation=utilisation,
            sharded=sharded,
        )

    def _on_gpu(self) -> bool:
        return "gpu" in self.world.device.lower()

    def device_report(self, state: TfState) -> dict[str, float | None]:
        if not self._on_gpu():
            return {}  # on a CPU the host's peak memory (always reported) is the device's
        from crosstrain.backends.tf.gpu import peak_memory_bytes

        return {
            "peak_device_memory_bytes": peak_memory_bytes(),
            "gpu_utilisation_percent": state.utilisation.stop() if state.utilisation else None,
        }

    def place_data(self, state: TfState, datasets: Datasets) -> None:
        state.feed.place(state.plan, datasets)

    # ----------------------------------------------------------------- steps

    def prefetch(self, state: TfState, step: StepBatch) -> None:
        state.feed.prefetch(step.micro_batches)

    def train_step(self, state: TfState, step: StepBatch, lr: float) -> dict[str, Any]:
        micro = step.micro_batches
        function, inputs = self._inputs(state, "train", micro)
        scale = state.loss_scale.scale if state.loss_scale else 1.0
        normaliser = step.global_real_targets
        plan = state.plan
        scalars = step_scalars(
            plan.optimizer, lr, state.optimizer_steps + 1, scale, normaliser, plan.train.weight_dtype
        )
        loss, finite = function(inputs, *pack_step(step, scalars))
        # only a step that can be skipped (fp16's overflow, on_nonfinite = "skip") is read
        # now: the loss scale and Adam's step count depend on it. Otherwise nothing is read
        # here, and the loop reads a chunk of steps' losses at once (resolve_metrics)
        applied = bool(finite) if guarded_steps(state.plan) else True
        if applied:
            state.optimizer_steps += 1
        if state.loss_scale is not None:
            state.loss_scale.update(applied)
        return {"loss": loss}

    def resolve_metrics(self, pending: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        """One read of a chunk of steps' metrics (float64 scalars where the steps left them)."""
        import tensorflow as tf

        names = list(pending[0])
        stacked = tf.stack(
            [tf.cast(metrics[name], tf.float64) for metrics in pending for name in names]
        ).numpy()
        values = stacked.reshape(len(pending), len(names)).tolist()
        return [dict(zip(names, row, strict=True)) for row in values]

    def eval_step(self, state: TfState, batch: Batch) -> dict[str, float]:
        function, inputs = self._inputs(state, "eval", [batch])
        rows = np.asarray(batch.rows, np.int64)
        sums = function(tuple(value[0] for value in inputs), batch.weight, rows).numpy()
        names = eval_names(state.plan)
        return {name: float(value) for name, value in zip(names, sums, strict=True)}

    def _inputs(
        self, state: TfState, kind: str, batches: Sequence[Batch]
    ) -> tuple[Any, tuple[np.ndarray, ...]]:
        """The compiled function for these batches and their inputs, stacked on a leading
        batch axis: the rows' indices when their data set is placed, the rows otherwise."""
        source = batches[0].source
        gathers = None if source is None else state.feed.gathers(source.dataset)
        if gathers is None:
            return self._host_inputs(state, kind, batches)
        assert source is not None
        key = (kind, id(source.dataset))
        if key not in state.functions:
            fetch = placed_rows(*gathers, self.world.local_replicas)
            state.functions[key] = self._function(state, kind, fetch)
        indices = np.stack([batch.source.indices for batch in batches if batch.source is not None])
        return state.functions[key], (indices.astype(np.int64),)

    def _host_inputs(
        self, state: TfState, kind: str, batches: Sequence[Batch]
    ) -> tuple[Any, tuple[np.ndarray, ...]]:
        """The rows as their data set stores them (uint8 images stay uint8 until the step
        casts and scales them on its device), with the function that converts them: already
        on each replica's device when they were read ahead (:meth:`prefetch`)."""
        prefetched = None if state.feed.prefetcher is None else state.feed.prefetcher.take(batches)
        if prefetched is not None:
            inputs, (dtype, scaling) = prefetched
            key: tuple[str, Any] = (kind, ("per replica", dtype, scaling))
            if key not in state.functions:
                # each replica's rows arrive as its own: nothing to cut, only to convert
                fetch = host_rows(1, state.feed.converter(dtype, scaling))
                state.functions[key] = self._function(state, kind, fetch)
            return state.functions[key], inputs
        xs, ys, (dtype, scaling) = host_inputs(batches)
        if xs.dtype == dtype and scaling is None:
            return (state.train_function if kind == "train" else state.eval_function), (xs, ys)
        key = (kind, (dtype, scaling))
        if key not in state.functions:
            convert = state.feed.converter(dtype, scaling)
            state.functions[key] = self._function(state, kind, host_rows(self.world.local_replicas, convert))
        return state.functions[key], (xs, ys)

    def _function(self, state: TfState, kind: str, fetch: Fetch) -> Any:
        """The train or eval function reading each replica's rows through ``fetch``."""
        local = self.world.local_replicas
        if kind == "train":
            return train_function(
                self.distribution,
                local,
                state.model,
                state.variables,
                state.slots,
                state.plan,
                fetch,
                state.sharded,
            )
        return eval_function(self.distribution, local, state.model, state.plan, fetch)

    def predict(self, state: TfState, x: np.ndarray) -> np.ndarray:
        if state.predict_function is None:
            state.predict_function = predict_function(self.distribution, state.model)
        return np.asarray(state.predict_function(x).numpy(), np.float32)

    def export_formats(self) -> tuple[str, ...]:
        return ("keras",)

    def export(self, state: TfState, format_name: str, out: Path, sample: np.ndarray) -> list[Path]:
        from crosstrain.backends.tf.export import export_keras

        scaling = state.plan.data.scaling  # the sample is raw rows; token ids are never scaled
        expected = self.predict(state, sample if scaling.is_identity else scaling.apply(sample))
        weights = self.state_dict(state)
        return export_keras(state.model, state.plan, weights, out, expected, sample)

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, values: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        values = np.asarray(values)
        if self.world.process_count == 1:
            return values
        rows = self._gather_from_processes(values)
        reduced = {
            "sum": rows.sum(axis=0),
            "mean": rows.mean(axis=0),
            "max": rows.max(axis=0),
            "min": rows.min(axis=0),
        }[op]
        return np.asarray(reduced).astype(values.dtype)

    def broadcast(self, values: np.ndarray, src: int = 0) -> np.ndarray:
        values = np.asarray(values)
        if self.world.process_count == 1:
            return values
        return np.asarray(self._gather_from_processes(values)[src])

    def barrier(self) -> None:
        # a collective every worker must join; MultiWorkerMirroredStrategy's
        # communication timeout bounds the wait
        if self.world.process_count > 1:
            self._gather_from_processes(np.zeros(1, np.float32))

    # ----------------------------------------------------------------- weights

    def state_dict(self, state: TfState) -> dict[str, np.ndarray]:
        from crosstrain.backends.tf.model import neutral_state

        return neutral_state(state.model, state.plan)

    def load_state_dict(self, state: TfState, tensors: Mapping[str, np.ndarray]) -> None:
        from crosstrain.backends.tf.model import load_neutral

        with self.distribution.scope():
            load_neutral(state.model, state.plan, tensors)

    def optimizer_state(self, state: TfState) -> Mapping[str, np.ndarray]:
        dtype = np.dtype(state.plan.train.weight_dtype)
        scalars = {"optimizer.step": np.asarray(state.optimizer_steps, np.int64)}
        if state.loss_scale is not None:
            scalars["loss_scale.scale"] = np.asarray(state.loss_scale.scale, np.float64)
            scalars["loss_scale.growth_tracker"] = np.asarray(state.loss_scale.finite_steps, np.int64)
        positions = self._slot_positions(state)
        if state.sharded is not None:
            gather = self._gather_from_processes if self.world.process_count > 1 else None
            return state.sharded.streamed(positions, scalars, dtype, gather)
        slots = {
            name: np.asarray(state.slots[index][kind].numpy(), dtype)
            for name, (index, kind) in positions.items()
        }
        return {**slots, **scalars}

    def memory_held(self, state: TfState) -> dict[str, int]:
        """One replica's copy (Mirrored keeps one per device): the trainable variables, a
        gradient for each, and the optimizer's slots."""

        def size(variable: Any) -> int:
            return int(np.prod(variable.shape.as_list(), dtype=np.int64)) * int(variable.dtype.size)

        parameters = sum(size(variable) for variable in state.variables)
        slots = sum(size(variable) for entry in state.slots for variable in entry)
        if state.sharded is not None:
            slots = state.sharded.bytes_held()
        return {"parameters": parameters, "gradients": parameters, "optimizer": slots}

    def load_optimizer_state(self, state: TfState, tensors: Mapping[str, np.ndarray]) -> None:
        positions = self._slot_positions(state)
        given = {name for name in tensors if name.startswith("optimizer.") and name != "optimizer.step"}
        if given - set(positions):
            raise KeyError(f"no tf variable for optimizer slots {sorted(given - set(positions))}")
        if state.sharded is not None:
            by_position = {position: name for name, position in positions.items()}
            state.sharded.load(lambda index, kind: tensors.get(by_position[index, kind]))
        named = {name: state.slots[index][kind] for name, (index, kind) in positions.items() if state.slots}
        with self.distribution.scope():
            for name, variable in named.items():
                # a slot the checkpoint lacks (torch keeps none for a weight never stepped) is zero
                value = tensors.get(name)
                value = np.zeros(variable.shape) if value is None else value
                variable.assign(np.asarray(value, variable.dtype.as_numpy_dtype))
        state.optimizer_steps = int(np.asarray(tensors.get("optimizer.step", 0)))
        if state.loss_scale is not None and "loss_scale.scale" in tensors:
            state.loss_scale.scale = float(tensors["loss_scale.scale"])
            state.loss_scale.finite_steps = int(tensors.get("loss_scale.growth_tracker", 0))

    def skips_nonfinite_steps(self) -> bool:
        return True

    def restarts_workers(self) -> bool:
        """The shared launcher restarts the group (``run_workers(max_restarts=...)``), and
        each restarted worker resumes (see ``worker.worker_main``)."""
        return True

    def _slot_positions(self, state: TfState) -> dict[str, tuple[int, int]]:
        """Every slot's neutral name (``optimizer.{weight}.{slot}``) -> (its trainable
        variable's index, its slot kind's index)."""
        from crosstrain.backends.tf.model import neutral_variables

        names = OPTIMIZER_SLOTS[state.plan.optimizer.name]
        kinds = range(slot_count(state.plan.optimizer))
        position = {id(variable): index for index, variable in enumerate(state.model.trainable_variables)}
        return {
            f"optimizer.{neutral}.{names[kind]}": (position[id(variable)], kind)
            for neutral, variable in neutral_variables(state.model).items()
            if id(variable) in position
            for kind in kinds
        }

    def _gather_from_processes(self, values: np.ndarray) -> np.ndarray:
        """Every process's ``values``, stacked in process order, on every process."""
        import tensorflow as tf

        if self._gather_function is None:
            distribution = self.distribution

            def replica_gather(tensor: Any) -> Any:
                # identity places the function's input on this replica's device, which
                # the collective needs as its destination
                return tf.distribute.get_replica_context().all_gather(tf.identity(tensor), axis=0)

            self._gather_function = tf.function(
                lambda tensor: distribution.run(replica_gather, args=(tensor,)), reduce_retracing=True
            )
        gathered = self._gather_function(tf.constant(values[None]))
        rows = self.distribution.experimental_local_results(gathered)[0].numpy()
        return np.asarray(rows[:: self.world.local_replicas])  # each process's first replica


# --------------------------------------------------------------------------- plan checks


def table_vocabulary() -> Vocabulary:
    """The keys of the tables the model and optimizer are built from (imports TensorFlow)."""
    from crosstrain.backends.tf.layers import LAYERS
    from crosstrain.backends.tf.model import DTYPE_POLICIES, LOSSES, METRIC_COUNTS
    from crosstrain.backends.tf.optimizer import OPTIMIZERS

    # every decay mode: each variable's rule decays or not as core chooses (decayed_variables)
    return Vocabulary.of(
        LAYERS,
        LOSSES,
        OPTIMIZERS,
        DTYPE_POLICIES,
        METRIC_COUNTS,
        DECAY_MODES,
        shard=("none", *SHARD_MODES),
        unsharded=UNSHARDED.items(),
    )


def check_compilable(plan: Plan) -> None:
    """train.compile puts each replica's forward and backward under XLA, which cannot hold
    batch norm's all-reduce of its statistics across replicas: refused before launch."""
    if not plan.train.compile or plan.model.native is not None:
        return
    for node in plan.model.graph(plan.source).nodes:
        if node.layer.type == "batchnorm":
            raise PlanError(
                f"the tf backend cannot compile batch norm ({node.field}): XLA cannot hold its "
                "all-reduce of statistics across replicas; train without train.compile",
                field="train.compile",
                source=plan.source,
            )
