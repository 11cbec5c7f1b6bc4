"""JaxStrategy: data parallel over the devices of one process, with jax.sharding.

One process drives every replica: the batch is sharded over a one-axis device mesh
('data'), the parameters are replicated, and XLA inserts the gradient all-reduce
itself. Under ``train.shard = "optimizer"`` (ZeRO-1) each slot of the optimizer's state
is split over the mesh too, along its first axis that divides by the device count: XLA
then updates each device's part of the slots (and of the weights, gathered whole after),
so each device holds 1/N of the optimizer's state, and the update's arithmetic, elementwise,
is the same. Under ``"full"`` (ZeRO-3) the weights are split the same way between steps:
each step gathers them whole for the forward and backward passes (an exact copy), splits
each summed gradient as its weight is split (a reduce-scatter), and updates each device's
part. This module imports jax only inside methods, so ``crosstrain backends`` can
list the backend (and say jax is missing) on a machine without jax."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import numpy as np
from crosstrain import (
    CORE_VOCABULARY,
    DECAY_MODES,
    BackendError,
    Batch,
    FrameworkStatus,
    Job,
    Plan,
    PlanError,
    ReduceOp,
    RunResult,
    StepBatch,
    Vocabulary,
    World,
    check_plan_vocabulary,
    dropout,
)

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh, NamedSharding

    from crosstrain_jax.optimizer import OptimizerState


@attrs.define
class JaxState:
    plan: Plan
    names: tuple[str, ...]  # every weight name in model order (state_dict's order)
    trainable: tuple[str, ...]  # the optimizer's weights in model order (the clip norm's order)
    params: dict[str, jax.Array]  # trainable weights
    buffers: dict[str, jax.Array]  # weights the forward pass updates (batch norm's statistics)
    optimizer_state: OptimizerState
    train_fn: Callable[..., Any]
    eval_fn: Callable[..., Any]
    replicated: NamedSharding
    rows: NamedSharding  # [batch, ...] arrays, batch split over the devices
    micro_rows: NamedSharding  # [micro-step, batch, ...] arrays, batch split over the devices
    #: each slot's placement: replicated, or split over the mesh (train.shard = "optimizer")
    optimizer_sharding: Any = None
    optimizer_steps: int = 0
    predict_fn: Callable[..., Any] | None = None  # jitted forward, made by the first predict()
    #: each trainable weight's placement: replicated, or split over the mesh (train.shard =
    #: "full"); a buffer, absent here, is replicated
    placements: Mapping[str, Any] = attrs.Factory(dict)
    shards: Any = None  # model.Shards under train.shard = "full", else None


class JaxStrategy:
    name: ClassVar[str] = "jax"
    install_hint: ClassVar[str] = "pip install 'crosstrain-jax' jax"

    def __init__(self, world: World | None = None, devices: Sequence[Any] | None = None) -> None:
        self.world = world or World()
        self.devices = list(devices) if devices is not None else None

    @classmethod
    def local(cls, device: Literal["cpu", "gpu"]) -> JaxStrategy:
        """World 1 in this process, on the first CPU or GPU device."""
        import jax

        try:
            found = jax.devices(device)
        except RuntimeError:
            found = []
        if not found:
            raise BackendError(f"--device {device}: jax sees no {device} device")
        return cls(World(device=f"{device}:0"), devices=found[:1])

    # ----------------------------------------------------------------- discovery and launch

    @classmethod
    def framework_installed(cls) -> FrameworkStatus:
        """Found, not imported: what crosstrain asks before each launch. The worker imports
        jax (and a broken install fails there, naming the rank); the probe below costs a
        python and a jax import, about a CPU-second, in a launcher that runs no step."""
        if importlib.util.find_spec("jax") is None:
            return FrameworkStatus(importable=False, problem=_NO_JAX)
        return FrameworkStatus(importable=True)

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        return _probe_framework()

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        """Every name core defines but fp16 (it would need a loss scaler, which this example
        leaves out). Declared rather than read off the tables, whose modules import jax (a
        CPU-second) in the launching process, which checks the plan but never runs a step;
        ``tests/test_vocabulary.py`` holds this to :func:`table_vocabulary`."""
        return attrs.evolve(
            CORE_VOCABULARY,
            precisions=CORE_VOCABULARY.precisions - {"fp16"},
            shard=frozenset(SHARD_MODES),
        )

    def check_job(self, job: Job) -> None:
        from crosstrain_jax.launch import check_job

        check_job(job)

    def launch(self, job: Job) -> RunResult:
        from crosstrain_jax.launch import launch

        return launch(job)

    def restarts_workers(self) -> bool:
        """crosstrain's shared launcher restarts the worker (``run_workers(max_restarts=...)``),
        which then resumes from the last checkpoint (see ``launch._train``)."""
        return True

    # ----------------------------------------------------------------- model

    def build(self, plan: Plan, weights: Mapping[str, np.ndarray]) -> JaxState:
        import jax
        from jax.sharding import Mesh

        from crosstrain_jax.model import (
            Shards,
            build_forward,
            gathered,
            make_eval_step,
            make_train_step,
        )
        from crosstrain_jax.nodes import use_x64
        from crosstrain_jax.optimizer import init_state

        # crosstrain checked this before launch; checked again for code that builds directly
        check_plan_vocabulary(plan, self.vocabulary(), self.name)
        use_x64(plan)  # before any array is made: fp64's weights stay float64
        dtype = plan.train.weight_dtype
        forward = build_forward(plan)
        devices = self.devices or jax.local_devices()[: self.world.local_replicas]
        mesh = Mesh(np.asarray(devices), ("data",))
        replicated = _sharding(mesh)
        names = tuple(weights)
        trainable = _trainable_names(plan, names)

        mode = plan.train.shard
        # "full": each trainable weight split over the devices (where an axis divides), as
        # its slots; the buffers stay whole, as the step returns them (one placement each,
        # so the step compiles once)
        placements = {name: _split_sharding(mesh, np.shape(weights[name])) if mode == "full"
                      else replicated for name in trainable}
        shards = Shards(parts=placements, whole=replicated) if mode == "full" else None

        def place(subset: Sequence[str]) -> dict[str, jax.Array]:
            return {name: jax.device_put(np.asarray(weights[name], dtype),
                                         placements.get(name, replicated))
                    for name in subset}

        params = place(trainable)
        slots = init_state(plan.optimizer, params)
        split = mode in ("optimizer", "full")
        slot_sharding = jax.tree.map(
            lambda slot: _split_sharding(mesh, slot.shape) if split else replicated, slots
        )
        train_fn = jax.jit(make_train_step(plan, forward, trainable, shards),
                           out_shardings=(placements, replicated, slot_sharding, replicated),
                           donate_argnums=(0, 1, 2))
        return JaxState(
            plan=plan, names=names, trainable=trainable, params=params,
            buffers=place([name for name in names if name not in params]),
            optimizer_state=jax.device_put(slots, slot_sharding),
            train_fn=train_fn, eval_fn=jax.jit(gathered(make_eval_step(plan, forward), shards)),
            replicated=replicated,
            rows=_sharding(mesh, "data"),
            micro_rows=_sharding(mesh, None, "data"),
            optimizer_sharding=slot_sharding,
            placements=placements,
            shards=shards,
        )

    # ----------------------------------------------------------------- steps

    def train_step(self, state: JaxState, step: StepBatch, lr: float) -> dict[str, float]:
        import jax

        from crosstrain_jax.optimizer import as_dtype, host_scalars

        micro = step.micro_batches
        xs, ys, ws, rows = (
            jax.device_put(np.stack(arrays), state.micro_rows)
            for arrays in ([batch.x for batch in micro],
                           [_targets(batch, state.plan) for batch in micro],
                           [batch.weight for batch in micro],
                           [_uint32(batch.rows) for batch in micro])
        )
        state.optimizer_steps += 1
        dtype = state.plan.train.weight_dtype
        scalars = as_dtype(host_scalars(state.plan.optimizer, lr, state.optimizer_steps), dtype)
        # one global computation over the whole batch, normalised once, by
        # the real target positions (rows for a label or a regression, rows x length for tokens)
        scale = np.dtype(dtype).type(1.0 / step.global_real_targets)
        state.params, state.buffers, state.optimizer_state, micro_sums = state.train_fn(
            state.params, state.buffers, state.optimizer_state, xs, ys, ws, rows, scale, scalars,
            _uint32(step.step),
        )
        loss_sum = float(np.asarray(micro_sums, np.float64).sum())
        return {"loss": loss_sum / step.global_real_targets}

    def eval_step(self, state: JaxState, batch: Batch) -> dict[str, float]:
        import jax

        from crosstrain_jax.model import LOSSES

        loss = LOSSES[state.plan.loss.name]
        x = jax.device_put(batch.x, state.rows)
        y = jax.device_put(_targets(batch, state.plan), state.rows)
        losses, hits = state.eval_fn({**state.params, **state.buffers}, x, y)
        # float64 sums on the host, in row order: identical for any number of devices
        weight = batch.weight.astype(np.float64)
        metrics = {"loss_sum": float((np.asarray(losses, np.float64) * weight).sum())}
        for name, counts in hits.items():
            metrics[name] = float((np.asarray(counts, np.float64) * weight).sum())
        metrics["count"] = float(weight.sum()) * loss.targets_per_row(batch.y.shape)
        return metrics

    def predict(self, state: JaxState, x: np.ndarray) -> np.ndarray:
        import jax

        from crosstrain_jax.model import build_forward, gathered

        if state.predict_fn is None:
            forward = build_forward(state.plan)
            state.predict_fn = jax.jit(
                gathered(lambda weights, rows: forward(weights, rows, None)[0], state.shards))
        # replicated: any number of rows, whatever the device count
        rows = jax.device_put(x, state.replicated)
        outputs = state.predict_fn({**state.params, **state.buffers}, rows)
        return np.asarray(outputs, np.float32)

    # ----------------------------------------------------------------- collectives
    # One process holds every replica, so there is nobody to reduce with: the device-level
    # reductions happen inside the compiled steps.

    def all_reduce(self, values: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        return values

    def broadcast(self, values: np.ndarray, src: int = 0) -> np.ndarray:
        return values

    def barrier(self) -> None:
        return None

    # ----------------------------------------------------------------- weights

    def state_dict(self, state: JaxState) -> dict[str, np.ndarray]:
        import jax

        host = jax.device_get({**state.params, **state.buffers})
        dtype = state.plan.train.weight_dtype
        return {name: np.array(host[name], dtype=dtype) for name in state.names}

    def load_state_dict(self, state: JaxState, tensors: Mapping[str, np.ndarray]) -> None:
        import jax

        current = {**state.params, **state.buffers}
        missing, unexpected = set(state.names) - set(tensors), set(tensors) - set(state.names)
        if missing or unexpected:
            raise PlanError(f"weights do not match the model: missing {sorted(missing)}, "
                            f"unexpected {sorted(unexpected)}")
        for name in state.names:
            expected = current[name].shape
            if tuple(tensors[name].shape) != expected:
                raise PlanError(f"weight {name!r} has shape {list(tensors[name].shape)}, "
                                f"the model expects {list(expected)}")

        def place(subset: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
            dtype = state.plan.train.weight_dtype  # float32 and float64 weights load into either
            return {name: jax.device_put(np.asarray(tensors[name], dtype),
                                         state.placements.get(name, state.replicated))
                    for name in subset}

        state.params, state.buffers = place(state.params), place(state.buffers)

    def memory_held(self, state: JaxState) -> dict[str, int]:
        """What the first device holds, counted from its shards of the arrays: the weights, a
        gradient for each trainable one (replicated, as the weights), the optimizer's slots."""
        import jax

        def held(tree: Any) -> int:
            leaves = jax.tree.leaves(tree)
            return sum(int(leaf.addressable_shards[0].data.nbytes) for leaf in leaves)

        parameters = held(state.params)
        return {"parameters": parameters, "gradients": parameters,
                "optimizer": held(state.optimizer_state)}

    def optimizer_state(self, state: JaxState) -> dict[str, np.ndarray]:
        """crosstrain's neutral names: ``optimizer.{weight}.{slot}`` and ``optimizer.step``;
        this backend's slots already carry core's slot names."""
        import jax

        host = jax.device_get(state.optimizer_state)
        dtype = state.plan.train.weight_dtype
        tensors = {f"optimizer.{name}.{slot}": np.array(value, dtype=dtype)
                   for slot, tree in host.items() for name, value in tree.items()}
        tensors["optimizer.step"] = np.asarray(state.optimizer_steps, np.int64)
        return tensors

    def load_optimizer_state(self, state: JaxState, tensors: Mapping[str, np.ndarray]) -> None:
        import jax

        known = {f"optimizer.{name}.{slot}" for slot, tree in state.optimizer_state.items()
                 for name in tree}
        given = {name for name in tensors
                 if name.startswith("optimizer.") and name != "optimizer.step"}
        if given - known:
            raise PlanError(f"optimizer slots that this model has not: {sorted(given - known)}")

        def slot_value(key: str, like: jax.Array) -> np.ndarray:
            # a slot the checkpoint lacks (torch keeps none for a weight never stepped) is zero
            value, dtype = tensors.get(key), state.plan.train.weight_dtype
            array = (np.zeros(like.shape, dtype) if value is None
                     else np.asarray(value, dtype))
            return array

        state.optimizer_state = jax.device_put({
            slot: {name: slot_value(f"optimizer.{name}.{slot}", value)
                   for name, value in tree.items()}
            for slot, tree in state.optimizer_state.items()
        }, state.optimizer_sharding)
        state.optimizer_steps = int(np.asarray(tensors.get("optimizer.step", 0)))


def _split_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """A slot split over the mesh along its first axis that divides by the device count;
    replicated where none does (a scalar, a small odd-sized bias)."""
    devices = mesh.devices.size
    for axis, size in enumerate(shape):
        if size % devices == 0:
            return _sharding(mesh, *([None] * axis), "data")
    return _sharding(mesh)


def _sharding(mesh: Mesh, *axes: str | None) -> NamedSharding:
    """Arrays laid out on the mesh: axis i split over the mesh axis named at i (None: whole)."""
    from jax.sharding import NamedSharding, PartitionSpec

    # jax leaves PartitionSpec.__init__ unannotated
    return NamedSharding(mesh, PartitionSpec(*axes))  # type: ignore[no-untyped-call]


def _targets(batch: Batch, plan: Plan) -> np.ndarray:
    from crosstrain_jax.model import LOSSES

    # jax runs 32-bit by default: int64 class ids go in as int32; a mixed row's targets
    # (label, partner's label, lam: mixup, cutmix) stay float32
    if batch.y.dtype.kind == "f" and plan.loss.name == "cross_entropy":
        return batch.y.astype(np.float32)
    return batch.y.astype(LOSSES[plan.loss.name].target_dtype)


def _uint32(values: np.ndarray | int) -> np.ndarray:
    """Dropout's counters as the 32-bit values its hash reads (jax holds no int64)."""
    return (np.asarray(values, np.int64) & dropout.MASK32).astype(np.uint32)


def _trainable_names(plan: Plan, names: Sequence[str]) -> tuple[str, ...]:
    """The weights the optimizer sees, in model order: core's specs say which are trainable."""
    specs = plan.model.graph(plan.source).weight_specs()
    return tuple(name for name in names if specs[name].trainable)


_NO_JAX = "No module named 'jax' (pip install jax)"
#: what each replica may hold: everything, 1/N of the optimizer's state (ZeRO-1), or 1/N of
#: the weights, their gradients and the optimizer's state (ZeRO-3)
SHARD_MODES = ("none", "optimizer", "full")


def table_vocabulary() -> Vocabulary:
    """The keys of the model's and optimizer's tables (imports jax, starts no jax backend)."""
    from crosstrain_jax.layers import LAYERS
    from crosstrain_jax.model import LOSSES, METRIC_COUNTS
    from crosstrain_jax.nodes import PRECISIONS
    from crosstrain_jax.optimizer import OPTIMIZERS

    # every decay mode: the update decays the weights crosstrain's decayed_weights names
    return Vocabulary.of(LAYERS, LOSSES, OPTIMIZERS, PRECISIONS, METRIC_COUNTS, DECAY_MODES,
                         shard=SHARD_MODES)


# Run in a child process: initialising a jax backend here would claim the GPUs (jax
# preallocates most of their memory) in the launching process, which never trains.
_PROBE = """
import json, jax
devices = ["cpu"] + [f"{d.platform}:{d.id} ({d.device_kind})"
                     for d in jax.devices() if d.platform != "cpu"]
print(json.dumps({"version": jax.__version__, "devices": devices}))
"""


@functools.cache
def _probe_framework() -> FrameworkStatus:
    """Whether jax imports and what it sees, asked of a child python; never raises."""
    if importlib.util.find_spec("jax") is None:
        return FrameworkStatus(importable=False, problem=_NO_JAX)
    try:
        completed = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                                   timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return FrameworkStatus(importable=False, problem=f"{type(error).__name__}: {error}")
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines() or [f"exit code {completed.returncode}"]
        return FrameworkStatus(importable=False, problem=lines[-1])
    try:
        found = json.loads(completed.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return FrameworkStatus(importable=False, problem="the jax probe printed no answer")
    return FrameworkStatus(importable=True, version=str(found["version"]),
                           devices=tuple(str(device) for device in found["devices"]))
