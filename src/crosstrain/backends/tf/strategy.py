"""TfStrategy: tf.distribute's MirroredStrategy (several replicas in one process) or
MultiWorkerMirroredStrategy (one process per worker), driven by a custom loop.

The optimizer (torch's semantics, in TensorFlow ops) lives in optimizer.py.

This module imports tensorflow only inside functions, so ``crosstrain backends`` can
list the backend (and say tensorflow is missing) on a machine without it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import numpy as np

from crosstrain.backends.tf.optimizer import (
    LOSS_SCALE,
    REAL_TARGETS,
    DynamicLossScale,
    clip_like_torch,
    make_slots,
    step_scalars,
    update_rule,
)
from crosstrain.core.data import ArrayDataset, Batch, Datasets, StepBatch
from crosstrain.core.errors import BackendError, PlanError
from crosstrain.core.plan import Plan
from crosstrain.core.strategy import OPTIMIZER_SLOTS, FrameworkStatus, Job, ReduceOp, RunResult, World
from crosstrain.core.vocabulary import Vocabulary

if TYPE_CHECKING:
    import keras

    from crosstrain.backends.tf.feed import TfFeed

#: (the step's input tensors, this replica's part) -> this replica's x and y rows: the
#: inputs are the rows themselves (x, y) or, from placed data, their indices (indices,)
Fetch = Callable[[tuple[Any, ...], Any], tuple[Any, Any]]

#: environment every TensorFlow process of crosstrain gets unless the user set it
TF_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


@attrs.define
class TfState:
    model: keras.Model
    plan: Plan
    variables: list[Any]  # what the optimizer updates: the trainable weights' variables
    slots: list[tuple[Any, ...]]  # optimizer state per trainable variable, mirrored like it
    feed: TfFeed  # the data sets placed on the replicas' devices, if they are
    # tf.function: (inputs, weights, rows, step, scalars, normaliser) -> (loss, finite), the
    # inputs (xs, ys) rows from the host, each with a leading micro-batch axis
    train_function: Any
    eval_function: Any  # tf.function: ((x, y), weight, rows) -> float64 [loss_sum, (correct,) count]
    optimizer_steps: int = 0  # steps applied so far: Adam's bias corrections count these
    loss_scale: DynamicLossScale | None = None
    predict_function: Any = None  # tf.function: x -> outputs, made by the first predict()
    #: ("train" | "eval", id(data set)) -> the function taking (indices,) of placed rows
    placed_functions: dict[tuple[str, int], Any] = attrs.field(factory=dict)


class TfStrategy:
    name: ClassVar[str] = "tf"
    install_hint: ClassVar[str] = "pip install 'crosstrain[tf]' (no GPU: 'crosstrain[tf-cpu]')"

    def __init__(self, world: World | None = None, distribution: Any = None) -> None:
        self.world = world or World()
        self._distribution = distribution  # a tf.distribute.Strategy; None: TF's default
        self._gather_function: Any = None

    @property
    def distribution(self) -> Any:
        if self._distribution is None:
            import tensorflow as tf

            self._distribution = tf.distribute.get_strategy()
        return self._distribution

    @classmethod
    def local(cls, device: Literal["cpu", "gpu"]) -> TfStrategy:
        """World 1 in this process: one replica on the CPU or on the first GPU."""
        for name, value in TF_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        import tensorflow as tf

        if device == "gpu" and not tf.config.list_physical_devices("GPU"):
            raise BackendError("--device gpu: tensorflow sees no GPU")
        name = "/gpu:0" if device == "gpu" else "/cpu:0"
        return cls(World(device=name.lstrip("/")), tf.distribute.OneDeviceStrategy(name))

    # ----------------------------------------------------------------- discovery and launch

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        if importlib.util.find_spec("tensorflow") is None:
            return FrameworkStatus(importable=False, problem="No module named 'tensorflow'")
        for name, value in TF_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        try:
            import tensorflow as tf

            # Physical devices only: the runtime stays uninitialised, so logical devices
            # can still be configured (in the workers, which is where training runs).
            gpus = tf.config.list_physical_devices("GPU")
        except Exception as error:  # a broken install must not break `crosstrain backends`
            return FrameworkStatus(importable=False, problem=f"{type(error).__name__}: {error}")
        devices = ("cpu", *(f"gpu:{index}" for index in range(len(gpus))))
        return FrameworkStatus(importable=True, version=str(tf.__version__), devices=devices)

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        """The keys of the tables the model and optimizer are built from."""
        from crosstrain.backends.tf.layers import LAYERS
        from crosstrain.backends.tf.model import DTYPE_POLICIES, LOSSES
        from crosstrain.backends.tf.optimizer import OPTIMIZERS

        return Vocabulary.of((layer.type for layer in LAYERS), LOSSES, OPTIMIZERS, DTYPE_POLICIES)

    def check_job(self, job: Job) -> None:
        from crosstrain.backends.tf.launch import cluster_from_environment, physical_gpus, plan_layout

        plan_layout(job, cluster_from_environment(), physical_gpus() if job.device != "cpu" else 0)
        check_compilable(job.plan)

    def spans_nodes(self) -> bool:
        """--nnodes and outside launchers (torchrun, SLURM, Kubeflow, TF_CONFIG): see launch.py."""
        return True

    def launch(self, job: Job) -> RunResult:
        from crosstrain.backends.tf.launch import launch

        return launch(job)

    # ----------------------------------------------------------------- model

    def build(self, plan: Plan, weights: Mapping[str, np.ndarray]) -> TfState:
        from crosstrain.backends.tf.feed import TfFeed
        from crosstrain.backends.tf.model import build_model, load_neutral

        with self.distribution.scope():
            model = build_model(plan)
            if weights:
                load_neutral(model, plan, weights)
            # the optimizer's variables: batch norm's moving statistics are not among them
            variables = [variable.value for variable in model.trainable_variables]
            slots = make_slots(plan.optimizer, variables)
        loss_scale = DynamicLossScale() if plan.train.precision == "fp16" else None
        fetch = _host_rows(self.world.local_replicas)
        return TfState(
            model,
            plan,
            variables,
            slots,
            TfFeed(self.distribution, "gpu" if "gpu" in self.world.device.lower() else "cpu"),
            self._train_function(model, variables, slots, plan, fetch),
            self._eval_function(model, plan, fetch),
            loss_scale=loss_scale,
        )

    def place_data(self, state: TfState, datasets: Datasets) -> None:
        state.feed.place(state.plan, datasets)

    # ----------------------------------------------------------------- steps

    def train_step(self, state: TfState, step: StepBatch, lr: float) -> dict[str, Any]:
        micro = step.micro_batches
        function, inputs = self._inputs(state, "train", micro)
        weights = np.stack([batch.weight for batch in micro])
        rows = np.stack([batch.rows for batch in micro]).astype(np.int64)
        scale = state.loss_scale.scale if state.loss_scale else 1.0
        normaliser = step.global_real_targets
        scalars = step_scalars(state.plan.optimizer, lr, state.optimizer_steps + 1, scale, normaliser)
        # the step is a tensor, not a Python int, so a new step does not retrace the function
        step_tensor = np.asarray(step.step, np.int64)
        loss, finite = function(
            inputs, weights, rows, step_tensor, scalars, np.asarray(normaliser, np.float64)
        )
        # only a step that can be skipped (fp16's overflow, on_nonfinite = "skip") is read
        # now: the loss scale and Adam's step count depend on it. Otherwise nothing is read
        # here, and the loop reads a chunk of steps' losses at once (resolve_metrics)
        applied = bool(finite) if _guarded(state.plan) else True
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
        names = ["loss_sum", "correct", "count"] if len(sums) == 3 else ["loss_sum", "count"]
        return {name: float(value) for name, value in zip(names, sums, strict=True)}

    def _inputs(
        self, state: TfState, kind: str, batches: Sequence[Batch]
    ) -> tuple[Any, tuple[np.ndarray, ...]]:
        """The compiled function for these batches and their inputs, stacked on a leading
        batch axis: the rows' indices when their data set is placed, the rows otherwise."""
        source = batches[0].source
        gathers = None if source is None else state.feed.gathers(source.dataset)
        if gathers is None:
            host = state.train_function if kind == "train" else state.eval_function
            return host, (np.stack([batch.x for batch in batches]), np.stack([batch.y for batch in batches]))
        assert source is not None
        key = (kind, id(source.dataset))
        if key not in state.placed_functions:
            state.placed_functions[key] = self._placed_function(state, kind, source.dataset)
        indices = np.stack([batch.source.indices for batch in batches if batch.source is not None])
        return state.placed_functions[key], (indices.astype(np.int64),)

    def _placed_function(self, state: TfState, kind: str, dataset: ArrayDataset) -> Any:
        gathers = state.feed.gathers(dataset)
        assert gathers is not None
        fetch = _placed_rows(*gathers, self.world.local_replicas)
        if kind == "train":
            return self._train_function(state.model, state.variables, state.slots, state.plan, fetch)
        return self._eval_function(state.model, state.plan, fetch)

    def predict(self, state: TfState, x: np.ndarray) -> np.ndarray:
        if state.predict_function is None:
            state.predict_function = self._predict_function(state.model)
        return np.asarray(state.predict_function(x).numpy(), np.float32)

    def export_formats(self) -> tuple[str, ...]:
        return ("keras",)

    def export(self, state: TfState, format_name: str, out: Path, sample: np.ndarray) -> list[Path]:
        from crosstrain.backends.tf.export import export_keras

        expected = self.predict(state, sample)
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

    def optimizer_state(self, state: TfState) -> dict[str, np.ndarray]:
        tensors: dict[str, np.ndarray] = {
            f"optimizer.{neutral}.{slot}": np.asarray(variable.numpy(), np.float32)
            for neutral, slot, variable in self._named_slots(state)
        }
        tensors["optimizer.step"] = np.asarray(state.optimizer_steps, np.int64)
        if state.loss_scale is not None:
            tensors["loss_scale.scale"] = np.asarray(state.loss_scale.scale, np.float64)
            tensors["loss_scale.growth_tracker"] = np.asarray(state.loss_scale.finite_steps, np.int64)
        return tensors

    def load_optimizer_state(self, state: TfState, tensors: Mapping[str, np.ndarray]) -> None:
        named = {
            f"optimizer.{neutral}.{slot}": variable for neutral, slot, variable in self._named_slots(state)
        }
        given = {name for name in tensors if name.startswith("optimizer.") and name != "optimizer.step"}
        if given - set(named):
            raise KeyError(f"no tf variable for optimizer slots {sorted(given - set(named))}")
        with self.distribution.scope():
            for name, variable in named.items():
                # a slot the checkpoint lacks (torch keeps none for a weight never stepped) is zero
                value = tensors.get(name)
                variable.assign(np.zeros(variable.shape, np.float32) if value is None else value)
        state.optimizer_steps = int(np.asarray(tensors.get("optimizer.step", 0)))
        if state.loss_scale is not None and "loss_scale.scale" in tensors:
            state.loss_scale.scale = float(tensors["loss_scale.scale"])
            state.loss_scale.finite_steps = int(tensors.get("loss_scale.growth_tracker", 0))

    def skips_nonfinite_steps(self) -> bool:
        return True

    def restarts_workers(self) -> bool:
        """The shared launcher restarts the group (``run_workers(max_restarts=...)``), and
        each restarted worker resumes (see ``launch.worker_main``)."""
        return True

    def _named_slots(self, state: TfState) -> list[tuple[str, str, Any]]:
        """(neutral weight name, neutral slot name, slot variable) for every slot."""
        from crosstrain.backends.tf.model import neutral_variables

        names = OPTIMIZER_SLOTS[state.plan.optimizer.name]
        position = {id(variable): index for index, variable in enumerate(state.model.trainable_variables)}
        named = []
        for neutral, variable in neutral_variables(state.model).items():
            index = position.get(id(variable))
            if index is not None:
                named += [(neutral, names[k], slot) for k, slot in enumerate(state.slots[index])]
        return named

    # ----------------------------------------------------------------- compiled functions

    def _train_function(
        self, model: Any, variables: list[Any], slots: list[tuple[Any, ...]], plan: Plan, fetch: Fetch
    ) -> Any:
        """One optimizer step as a tf.function: each replica runs forward and backward on
        its rows of every micro-batch (``fetch``: from the host's rows or the placed data;
        with their row mask, global row positions and the step, for batch norm and
        dropout), each micro-batch's weighted loss sum divided by the step's real target
        positions; gradients are summed across replicas (rule 4), then every copy of every
        variable gets the same update. Returns the step's mean loss (the loss sum over all
        replicas / ``normaliser``) and whether its update was applied, as tensors."""
        import tensorflow as tf

        from crosstrain.backends.tf.model import forward, per_row_loss

        distribution, local = self.distribution, self.world.local_replicas
        train, loss_name = plan.train, plan.loss.name
        scaled = train.precision == "fp16"
        guarded = _guarded(plan)
        rule = update_rule(plan.optimizer)
        keras_variables = list(model.trainable_variables)

        def replica_gradients(micro: list[tuple[Any, ...]], step: Any, scalars: Any) -> tuple[list[Any], Any]:
            """This replica's gradients and loss sum over its (x, y, weight, rows) of each
            micro-batch: no cross-replica op unless the model has batch norm (which
            train.compile refuses at world > 1), so XLA may compile it."""
            grads: list[Any] = []
            loss_sum = tf.zeros((), tf.float64)
            for index, (x, y, weight, row) in enumerate(micro):
                with tf.GradientTape() as tape:
                    outputs = forward(model, x, training=True, weight=weight, rows=row, step=step)
                    micro_sum = tf.reduce_sum(per_row_loss(loss_name, outputs, y) * weight)
                    loss = micro_sum / scalars[REAL_TARGETS]
                    if scaled:
                        loss = loss * scalars[LOSS_SCALE]
                micro_grads = tape.gradient(loss, keras_variables)
                micro_grads = [_dense_gradient(g, v) for g, v in zip(micro_grads, variables, strict=True)]
                grads = (
                    micro_grads if index == 0 else [a + b for a, b in zip(grads, micro_grads, strict=True)]
                )
                loss_sum += tf.cast(micro_sum, tf.float64)
            return grads, loss_sum

        if train.compile:
            # XLA compiles each replica's forward and backward (as Keras 3 does); the
            # all-reduce and the update stay outside, where the strategy places them
            replica_gradients = tf.function(replica_gradients, jit_compile=True)

        def replica_step(
            inputs: tuple[Any, ...], weights: Any, rows: Any, step: Any, scalars: Any
        ) -> tuple[Any, Any, Any]:
            context = tf.distribute.get_replica_context()
            part = context.replica_id_in_sync_group % local
            micro = []
            for index in range(train.grad_accum_steps):
                # the rows are gathered here, outside XLA: placed data's variables stay out of it
                x, y = fetch(tuple(tensor[index] for tensor in inputs), part)
                micro.append(
                    (x, y, replica_rows(weights[index], part, local), replica_rows(rows[index], part, local))
                )
            grads, loss_sum = replica_gradients(micro, step, scalars)
            grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
            finite = tf.constant(True)
            if scaled:
                grads = [g * (1.0 / scalars[LOSS_SCALE]) for g in grads]
            if guarded:
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            if train.clip_grad_norm is not None:
                grads = clip_like_torch(grads, train.clip_grad_norm)
            return grads, loss_sum, finite

        def apply(variable: Any, grad: Any, finite: Any, scalars: Any, *state: Any) -> Any:
            value, new_state = rule(variable, grad, state, scalars)
            if guarded:  # an inf/nan step is skipped, as GradScaler skips optimizer.step()
                value = tf.where(finite, value, variable)
                new_state = tuple(
                    tf.where(finite, new, old) for new, old in zip(new_state, state, strict=True)
                )
            for slot, new in zip(state, new_state, strict=True):
                slot.assign(new)
            return variable.assign(value)

        def train_function(
            inputs: tuple[Any, ...], weights: Any, rows: Any, step: Any, scalars: Any, normaliser: Any
        ) -> tuple[Any, Any]:
            grads, loss_sum, finite = distribution.run(
                replica_step, args=(inputs, weights, rows, step, scalars)
            )
            for variable, grad, state in zip(variables, grads, slots, strict=True):
                distribution.extended.update(
                    variable, apply, args=(grad, finite, scalars, *state), group=False
                )
            total = distribution.reduce(tf.distribute.ReduceOp.SUM, loss_sum, axis=None)
            # a float64 division: the same bits as float(total) / normaliser on the host
            return total / normaliser, distribution.experimental_local_results(finite)[0]

        return tf.function(train_function)

    def _eval_function(self, model: Any, plan: Plan, fetch: Fetch) -> Any:
        """Float64 sums over the real rows of the whole global batch, across every replica;
        ``fetch`` reads each replica's rows (from the host's rows or the placed data)."""
        import tensorflow as tf

        from crosstrain.backends.tf.model import correct_per_row, forward, per_row_loss, targets_per_row

        distribution, local = self.distribution, self.world.local_replicas
        classify = plan.loss.name == "cross_entropy"

        def replica_eval(inputs: tuple[Any, ...], weight: Any, rows: Any) -> Any:
            part = tf.distribute.get_replica_context().replica_id_in_sync_group % local
            x, y = fetch(inputs, part)
            weight, rows = (replica_rows(t, part, local) for t in (weight, rows))
            outputs = forward(model, x, training=False, weight=weight, rows=rows)
            weight = tf.cast(weight, tf.float64)
            sums = [tf.reduce_sum(tf.cast(per_row_loss(plan.loss.name, outputs, y), tf.float64) * weight)]
            if classify:
                sums.append(tf.reduce_sum(tf.cast(correct_per_row(outputs, y), tf.float64) * weight))
            sums.append(tf.reduce_sum(weight) * targets_per_row(y))
            return tf.stack(sums)

        def eval_function(inputs: tuple[Any, ...], weight: Any, rows: Any) -> Any:
            per_replica = distribution.run(replica_eval, args=(inputs, weight, rows))
            return distribution.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        return tf.function(eval_function)

    def _predict_function(self, model: Any) -> Any:
        """Inference outputs as float32, on this process's (one) replica."""
        import tensorflow as tf

        from crosstrain.backends.tf.model import forward

        distribution = self.distribution

        def predict_function(x: Any) -> Any:
            outputs = distribution.run(
                lambda rows: tf.cast(forward(model, rows, training=False), tf.float32), args=(x,)
            )
            return distribution.experimental_local_results(outputs)[0]

        return tf.function(predict_function, reduce_retracing=True)

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


# --------------------------------------------------------------------------- tensor helpers


def _guarded(plan: Plan) -> bool:
    """Whether a step's update can be skipped: fp16 skips an overflowing step (as
    GradScaler does); on_nonfinite = "skip" any step whose summed gradients are not finite."""
    return plan.train.precision == "fp16" or plan.train.on_nonfinite == "skip"


def _host_rows(local: int) -> Fetch:
    """This replica's rows of the (x, y) gathered on the host."""

    def fetch(inputs: tuple[Any, ...], part: Any) -> tuple[Any, Any]:
        x, y = inputs
        return replica_rows(x, part, local), replica_rows(y, part, local)

    return fetch


def _placed_rows(gather_x: Callable[[Any], Any], gather_y: Callable[[Any], Any], local: int) -> Fetch:
    """This replica's rows gathered from the placed data (its device's copy) by index."""

    def fetch(inputs: tuple[Any, ...], part: Any) -> tuple[Any, Any]:
        (indices,) = inputs
        mine = replica_rows(indices, part, local)
        return gather_x(mine), gather_y(mine)

    return fetch


def _dense_gradient(grad: Any, variable: Any) -> Any:
    """A dense gradient for every variable: zeros where the loss does not reach it, and
    an embedding's IndexedSlices made dense, which the all-reduce and the update need."""
    import tensorflow as tf

    return tf.zeros_like(variable) if grad is None else tf.convert_to_tensor(grad)


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


def replica_rows(tensor: Any, part: Any, parts: int) -> Any:
    """Contiguous slice ``part`` of ``parts`` along the first axis, with a static shape."""
    import tensorflow as tf

    if parts == 1:
        return tensor
    rows = tensor.shape[0] // parts
    return tf.gather(tf.reshape(tensor, [parts, rows, *tensor.shape[1:]]), part)
