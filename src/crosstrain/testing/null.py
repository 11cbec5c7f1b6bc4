"""Backends without a framework, whose whole world is the calling process: for what the loop,
the plugin manager and the CLI do on their own (their tests, in pytest's process and in the
framework-free env), and for the loop's own host time per step
(``benchmarks/bench_loop_floor.py``).

The module is a crosstrain plugin, loaded by name (it is no entry point, so a user's
``crosstrain backends`` never lists it)::

    crosstrain -p crosstrain.testing.null run plan.toml --backend null

``launch`` runs the worker side (:func:`crosstrain.core.run.worker.run_worker`: the job's
plugins, the loop) right here, so ``crosstrain.cli.main([...])`` trains in the caller's
process. Two backends:

- ``null`` (:class:`NullStrategy`) trains nothing: the loss of step ``s`` is ``s``, the
  weights stay the plan's initial ones (model.safetensors holds the plan's real names and
  shapes), the optimizer's state is the count of steps applied;
- ``momentum`` (:class:`MomentumStrategy`) is a small numpy model whose weights, momentum
  and step count depend on every batch it saw and in which order, so a resumed run equals
  an uninterrupted one only if all of them and the sampler's position come back.

Both save and load their whole state (``--resume``, ``output.checkpoint_every_steps``).
"""

from __future__ import annotations

import abc
import time
import traceback
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.errors import BackendError, Interrupted, WorkerError
from crosstrain.core.run.job import Job, RunResult, World
from crosstrain.core.run.strategy import DistributedStrategy, FrameworkStatus
from crosstrain.core.run.worker import run_worker
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, Vocabulary
from crosstrain.launch.outcomes import error_report
from crosstrain.plugins.hookspecs import hookimpl

#: the state both backends keep: names to numpy arrays and counts
State = dict[str, Any]


class LazyLoss:
    """A step's loss as a backend leaves it on its device: read by ``float()``, when the loop
    reads a chunk of steps."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value


class InProcessStrategy(abc.ABC):
    """What a backend whose world is this one process shares: ``launch`` runs the worker
    here, holding every replica (as tf's MirroredStrategy holds them in one process), and
    the collectives of a world of one process return what they are given. A subclass
    names itself and adds the model."""

    name: ClassVar[str]
    install_hint: ClassVar[str] = ""
    world = World()

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        """No framework to import: always ready (the admission step asks)."""
        return FrameworkStatus(importable=True, version=f"numpy {np.__version__}", devices=("cpu",))

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        """It builds no layer, loss or optimizer, so it can run every plan core can describe."""
        return CORE_VOCABULARY

    def check_job(self, job: Job) -> None:
        if job.workers not in (None, 1):
            raise BackendError(f"--workers {job.workers}: the {job.backend} backend runs in one process")
        if job.device == "gpu":
            raise BackendError(f"--device gpu: the {job.backend} backend runs on the CPU")

    def launch(self, job: Job) -> RunResult:
        """Train in this process; a failure raises :class:`WorkerError` as a launcher's does
        (rank 0, its one-line message, its traceback, its exit code)."""
        self.world = World(local_replicas=job.replicas)
        try:
            summary = run_worker(self, job)
        except Interrupted:  # Ctrl-C or SIGTERM: the CLI says "interrupted", as for any launcher
            raise
        except Exception as error:
            report = error_report(error, traceback.format_exc(), time.time())
            raise WorkerError(
                0, report["message"], report["traceback"], exit_code=report["exit_code"]
            ) from error
        return RunResult(summary, job.out_dir)

    def barrier(self) -> None:  # noqa: B027 (deliberately empty, not abstract: no other process to wait for)
        pass

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return values

    def broadcast(self, values: np.ndarray, src: int = 0) -> np.ndarray:
        return values

    @abc.abstractmethod
    def build(self, plan: Any, weights: Mapping[str, np.ndarray]) -> State: ...

    @abc.abstractmethod
    def train_step(self, state: State, step: StepBatch, lr: float) -> Mapping[str, Any]: ...

    @abc.abstractmethod
    def eval_step(self, state: State, batch: Batch) -> dict[str, float]: ...

    @abc.abstractmethod
    def state_dict(self, state: State) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: State, tensors: Mapping[str, np.ndarray]) -> None: ...


class NullStrategy(InProcessStrategy):
    """Each step's loss is its number (1, 2, ...); ``read_rows``: each step also reads its
    rows on the host, as a backend whose data is not placed does."""

    name: ClassVar[str] = "null"

    def __init__(self, read_rows: bool = False) -> None:
        self.read_rows = read_rows

    def build(self, plan: Any, weights: Mapping[str, np.ndarray]) -> State:
        return {"weights": {name: np.array(value) for name, value in weights.items()}, "steps": 0}

    def train_step(self, state: State, step: StepBatch, lr: float) -> dict[str, Any]:
        if self.read_rows:
            for micro in step.micro_batches:
                _ = micro.x, micro.y
        state["steps"] += 1
        return {"loss": LazyLoss(float(step.step + 1))}

    def eval_step(self, state: State, batch: Batch) -> dict[str, float]:
        return {"loss_sum": 0.0, "correct": 0.0, "top_k_correct": 0.0, "count": float(batch.weight.sum())}

    def state_dict(self, state: State) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in state["weights"].items()}

    def load_state_dict(self, state: State, tensors: Mapping[str, np.ndarray]) -> None:
        state["weights"] = {name: np.array(value) for name, value in tensors.items()}

    def optimizer_state(self, state: State) -> dict[str, np.ndarray]:
        return {"optimizer.step": np.asarray(state["steps"])}

    def load_optimizer_state(self, state: State, tensors: Mapping[str, np.ndarray]) -> None:
        state["steps"] = int(tensors["optimizer.step"])


class MomentumStrategy(InProcessStrategy):
    """w <- w - lr * m with m <- 0.9 m + mean(x of the batch's rows); loss = w^2 + batch mean;
    eval loss = w^2, which falls, then (at a large lr) overshoots and rises.
    ``fail_at``: raise at that step; ``nan_at``: that step's loss is NaN."""

    name: ClassVar[str] = "momentum"

    def __init__(self, fail_at: int | None = None, nan_at: int | None = None) -> None:
        self.fail_at, self.nan_at = fail_at, nan_at

    def build(self, plan: Any, weights: Mapping[str, np.ndarray]) -> State:
        return {"w": np.ones(3), "m": np.zeros(3), "steps": 0}

    def train_step(self, state: State, step: StepBatch, lr: float) -> dict[str, float]:
        if step.step + 1 == self.fail_at:
            raise RuntimeError(f"failed at step {self.fail_at}")
        batch = step.micro_batches[0]
        features = batch.x.reshape(len(batch.weight), -1)[:, :3]
        signal = (features * batch.weight[:, None]).sum(axis=0) / max(batch.real_rows, 1)
        state["m"] = 0.9 * state["m"] + signal
        state["w"] = state["w"] - lr * state["m"]
        state["steps"] += 1
        loss = float((state["w"] ** 2).sum() + signal.sum())
        return {"loss": float("nan") if step.step + 1 == self.nan_at else loss}

    def eval_step(self, state: State, batch: Batch) -> dict[str, float]:
        count = float(batch.weight.sum())
        loss_sum = float((state["w"] ** 2).sum()) * count
        return {"loss_sum": loss_sum, "correct": 0.0, "top_k_correct": 0.0, "count": count}

    def state_dict(self, state: State) -> dict[str, np.ndarray]:
        return {"w": state["w"].copy()}

    def load_state_dict(self, state: State, tensors: Mapping[str, np.ndarray]) -> None:
        state["w"] = np.array(tensors["w"])

    def optimizer_state(self, state: State) -> dict[str, np.ndarray]:
        return {"optimizer.w.momentum": state["m"].copy(), "optimizer.step": np.asarray(state["steps"])}

    def load_optimizer_state(self, state: State, tensors: Mapping[str, np.ndarray]) -> None:
        state["m"] = np.array(tensors["optimizer.w.momentum"])
        state["steps"] = int(tensors["optimizer.step"])


@hookimpl
def crosstrain_backends() -> list[type[DistributedStrategy]]:
    return [NullStrategy, MomentumStrategy]
