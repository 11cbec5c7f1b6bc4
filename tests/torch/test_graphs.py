"""Which steps are replayed as one CUDA graph (the table of what blocks a capture), and
the host's side of the replays on a CPU, where a stand-in records and replays the step's
ops as a CUDA graph does. (The real graph: tests/torch/test_gpu.py.)"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from crosstrain.backends.torch.graphs import WARMUP_STEPS, Replayable, StepGraph, capture_blocker  # noqa: E402
from crosstrain.core.data.batches import GlobalSampler  # noqa: E402
from crosstrain.core.run.loading import load_datasets  # noqa: E402
from crosstrain.core.spec.planfile import load_plan  # noqa: E402
from crosstrain.testing.launches import write_plan  # noqa: E402
from crosstrain.testing.runs import max_relative_difference  # noqa: E402

pytestmark = pytest.mark.torch


def _blocker(
    tmp_path: Path, name: str, *settings: str, device: str = "cuda:0", processes: int = 1
) -> str | None:
    plan = load_plan(write_plan(tmp_path, name), settings)
    return capture_blocker(plan, device, processes)


def test_one_gpu_process_is_captured_with_every_optimizer(tmp_path: Path) -> None:
    for optimizer in ("sgd", "adam", "adamw"):
        assert _blocker(tmp_path, "dropout_mlp", f"optimizer.name='{optimizer}'") is None
    assert _blocker(tmp_path, "dropout_mlp", "train.precision='bf16'", "train.clip_grad_norm=1.0") is None
    assert _blocker(tmp_path, "dropout_mlp", "train.grad_accum_steps=2") is None


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (("train.cuda_graph=false",), "train.cuda_graph is false"),
        (("train.compile=true",), "train.compile replays its own graphs"),
        (("train.precision='fp16'",), "fp16's loss scaler reads the device"),
        (("train.precision='fp64'",), "fp64: a captured update reads its learning rate in float32"),
        (("train.on_nonfinite='skip'",), 'on_nonfinite = "skip" reads the device'),
    ],
)
def test_what_the_plan_asks_can_block_the_capture(
    tmp_path: Path, settings: tuple[str, ...], reason: str
) -> None:
    assert _blocker(tmp_path, "dropout_mlp", *settings) == reason


def test_the_machine_and_the_model_can_block_the_capture(tmp_path: Path) -> None:
    assert _blocker(tmp_path, "dropout_mlp", device="cpu") == "not on a GPU"
    assert _blocker(tmp_path, "dropout_mlp", processes=2) == "several processes (DDP)"
    assert _blocker(tmp_path, "gpt") == "an embedding's backward syncs with the host (pytorch#82886)"


# --------------------------------------------------------------- the replays, on a CPU


class _CapturedOps(TorchDispatchMode):
    """What a CUDA graph does with a step, on a CPU: capturing records every op the step
    runs and leaves every tensor made before it as it was (a capture runs no kernel);
    a replay runs the ops again on the same tensors and writes each fresh result where the
    capture's went (a graph's fixed addresses). So a value the step took from the host at
    capture (a Python number, a tensor made anew since) is what every replay uses, as on a
    GPU, and an op that reads the device from the host fails the capture."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self._made: set[int] = set()  # storages the capture allocated
        self._before: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing (a host read)")
        for tensor in _written(func, args, kwargs):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._made and storage.data_ptr() not in self._before:
                self._before[storage.data_ptr()] = (storage, storage.clone())
        result = func(*args, **kwargs)
        read = {tensor.untyped_storage().data_ptr() for tensor in _tensors((args, kwargs))}
        self._made |= {out.untyped_storage().data_ptr() for out in _tensors(result)} - read
        self.ops.append((func, args, kwargs, result))
        return result

    def undo(self) -> None:
        for storage, before in self._before.values():
            storage.copy_(before)

    def replay(self) -> None:
        with torch._C._AutoDispatchBelowADInplaceOrView():  # as the capture saw them: below autograd
            self._run_again()

    def _run_again(self) -> None:
        for func, args, kwargs, captured in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(_tensors(captured), _tensors(fresh), strict=True):
                if old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                    old.copy_(new)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place (``Tensor(a!)`` in its schema)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += _tensors(value)
    return written


class _StepGraphOnACpu(StepGraph):
    """StepGraph with its two CUDA calls (the warm-up's side stream, the capture) done by
    :class:`_CapturedOps`: everything else, the host's side of every replay, is its own."""

    def _on_side_stream(self, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        return work()

    def _record(self, work: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        ops = _CapturedOps()
        with ops:
            result = work()
        ops.undo()
        return ops, result


class _LossesByStep:
    """The loop's hooks: every step's loss; a failure after ``fail_after`` steps."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.losses: list[float] = []
        self.fail_after = fail_after

    def crosstrain_step_end(self, metrics: Mapping[str, float], **_: Any) -> None:
        self.losses.append(metrics["loss"])
        if len(self.losses) == self.fail_after:
            raise _Interrupted

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda **kwargs: None


class _Interrupted(Exception):
    pass


#: how a step runs: its kernels launched one by one (no graph: the optimizer's plain
#: update); the graph-ready step (as build() makes it for a GPU: the capturable update, the
#: rate and the step counter on the device, the row mask on every batch) run eagerly every
#: step; or that step captured once and replayed by :class:`_StepGraphOnACpu`
LAUNCHED, GRAPH_READY, REPLAYED = "launched", "graph-ready", "replayed"


def _train_on_a_cpu(
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    plan_file: Path,
    how: str,
    *settings: str,
    resume: bool = False,
    fail_after: int | None = None,
) -> tuple[list[float], StepGraph | None]:
    """The loop in this process on the CPU, its steps run ``how``; the losses of the steps
    it ran, and the step's graph (None when launched or interrupted)."""
    from crosstrain.backends.torch import graphs
    from crosstrain.backends.torch.strategy import TorchStrategy
    from crosstrain.core.run.job import Job, LaunchOptions, Layout
    from crosstrain.core.run.loop import train

    on_a_gpu = graphs.capture_blocker
    recorder = _LossesByStep(fail_after)
    with monkeypatch.context() as patch:
        if how != LAUNCHED:
            patch.setattr(
                graphs, "capture_blocker", lambda plan, device, processes: on_a_gpu(plan, "cuda:0", processes)
            )
            patch.setattr(graphs, "StepGraph", _StepGraphOnACpu)
        if how == GRAPH_READY:  # every step a warm-up step: the graph's update, never captured
            patch.setattr(graphs, "WARMUP_STEPS", sys.maxsize)
        plan = load_plan(plan_file, settings)
        job = Job(
            plan=plan, layout=Layout("torch", 1), launch=LaunchOptions(resume=resume), out_dir=str(folder)
        )
        try:
            _, state = train(TorchStrategy.local("cpu"), job, recorder)  # type: ignore[arg-type]
        except _Interrupted:
            return recorder.losses, None
    graph = state.step_graph
    assert (graph is not None) == (how != LAUNCHED)
    assert graph is None or (graph.replays == 0) == (how == GRAPH_READY)
    return recorder.losses, graph


#: a learning rate that moves every step, a new epoch order (and where the rows are no
#: multiple of the batch, as the dropout MLP's and the ResNet's, a padded last batch)
SCHEDULED = ("schedule.name='cosine'", "schedule.warmup_steps=5", "train.epochs=2")


#: the ways the step is graphed, each on a plan that exercises it
GRAPHED_STEPS = pytest.mark.parametrize(
    ("plan_name", "settings"),
    [
        # rows gathered in the step from the placed arrays; dropout reads the step counter
        ("dropout_mlp", ("data.placement='device'", "train.clip_grad_norm=0.5")),
        # batch norm's running statistics, AdamW's decay
        ("resnet", ("data.placement='device'", "optimizer.name='adamw'", "optimizer.weight_decay=0.1")),
        # SGD with momentum, Nesterov and weight decay: its fused kernel, the rate on the device
        (
            "resnet",
            (
                "data.placement='device'",
                "optimizer.name='sgd'",
                "optimizer.momentum=0.9",
                "optimizer.nesterov=true",
                "optimizer.weight_decay=0.01",
            ),
        ),
        ("dropout_mlp", ("data.placement='host'", "optimizer.name='sgd'", "optimizer.lr=0.05")),
        # rows from the host copied in before each replay (uint8 pixels, scaled)
        ("scaled_images", ("data.placement='host'", "optimizer.name='adam'")),
        # gradient accumulation: every micro-batch's forward and backward in the one graph
        ("dropout_mlp", ("data.placement='device'", "train.grad_accum_steps=2")),
        ("scaled_images", ("data.placement='host'", "optimizer.name='adam'", "train.grad_accum_steps=2")),
    ],
)

#: the graph-ready step against the launched one: the first AGREEING_STEPS steps from a
#: shared state, each loss within ROUNDING (relative; fp32's ulp is 2**-23 ~ 1.2e-7)
AGREEING_STEPS, ROUNDING = 3, 1e-6


@GRAPHED_STEPS
def test_the_replayed_step_trains_as_the_graph_ready_step_run_eagerly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plan_name: str, settings: tuple[str, ...]
) -> None:
    """The host's side of the graph (what it writes before each replay: the row indices,
    the mask of a padded batch, the learning rate, the step counter) gives, replay after
    replay, the losses of the same step run eagerly at every step: equal, not close. Both
    runs execute the same ops (the capture records the warm-up's own, build() makes one
    optimizer for both) on the same values in the same order, in one process: whatever a
    CPU's kernels round, they round alike in both, so any difference is a value the host
    failed to write. The GPU tests run the same on a real CUDA graph."""
    plan = write_plan(tmp_path, plan_name)
    run = (*SCHEDULED, *settings)
    eager, _ = _train_on_a_cpu(monkeypatch, tmp_path / "eager", plan, GRAPH_READY, *run)
    replayed, graph = _train_on_a_cpu(monkeypatch, tmp_path / "replayed", plan, REPLAYED, *run)
    assert graph is not None and graph.replays == len(replayed) - WARMUP_STEPS >= 30
    assert replayed == eager


@GRAPHED_STEPS
def test_the_graph_ready_step_trains_like_the_launched_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plan_name: str, settings: tuple[str, ...]
) -> None:
    """The step a graph captures computes the launched step's function with other ops:
    the update that reads its rate and count from the device (capturable Adam, fused SGD),
    the masked batch norm and loss on every batch. So the two round differently, and in a
    ReLU/batch-norm ResNet that difference grows step by step at a rate set by the CPU's
    kernels (fused kernels with or without FMA, AVX-512 or not). They are judged as
    ``compare`` judges runs, by their agreement horizon: from one shared state (the start,
    and a checkpoint two steps before an epoch's last batch, so a padded batch's mask
    (the dropout MLP's, the ResNet's) and the next epoch's order are covered), the first
    AGREEING_STEPS steps agree within ROUNDING.
    That holds on any CPU: the first loss from a shared state differs only by how the loss
    is summed (a few ulps), and the next ones by an update or two of rounding, too few
    steps for any growth (measured: <= 2e-7 on an AMD EPYC, ~1e-7 on an Intel Xeon);
    a wrong rate, counter, mask or row is >= 1e-3 off at once."""
    plan = write_plan(tmp_path, plan_name)
    run = (*SCHEDULED, *settings)
    near_the_end = _steps_per_epoch(plan, run) - 2  # then the epoch's last batch, then a new epoch
    launched = tmp_path / "launched"
    checkpointed = (f"output.checkpoint_every_steps={near_the_end}", "output.log_every_steps=1")
    first, _ = _train_on_a_cpu(
        monkeypatch, launched, plan, LAUNCHED, *run, *checkpointed, fail_after=near_the_end + 1
    )
    graphed, _ = _train_on_a_cpu(
        monkeypatch, tmp_path / "graphed", plan, GRAPH_READY, *run, fail_after=AGREEING_STEPS
    )
    assert _agreeing_steps(graphed, first[:AGREEING_STEPS]) == AGREEING_STEPS, (graphed, first)
    later: dict[str, list[float]] = {}
    for how in (LAUNCHED, GRAPH_READY):  # each resumed from the launched run's checkpoint
        shutil.copytree(launched, tmp_path / f"resumed-{how}")
        later[how], _ = _train_on_a_cpu(
            monkeypatch, tmp_path / f"resumed-{how}", plan, how, *run,
            resume=True, fail_after=AGREEING_STEPS,
        )  # fmt: skip
    assert len(later[LAUNCHED]) == AGREEING_STEPS and later[LAUNCHED][0] == first[near_the_end]
    assert _agreeing_steps(later[GRAPH_READY], later[LAUNCHED]) == AGREEING_STEPS, later


def _steps_per_epoch(plan_file: Path, settings: tuple[str, ...]) -> int:
    plan = load_plan(plan_file, settings)
    rows = len(load_datasets(plan).train)
    return GlobalSampler(rows, plan.train.global_batch_size, plan.seed).steps_per_epoch


def _agreeing_steps(losses: list[float], reference: list[float]) -> int:
    """How many leading steps' losses are within ROUNDING (relative) of the reference's."""
    agreeing = 0
    for loss, expected in zip(losses, reference, strict=True):
        if abs(loss - expected) > ROUNDING * abs(expected):
            break
        agreeing += 1
    return agreeing


def test_a_value_the_host_stops_writing_is_frozen_in_the_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The stand-in can fail: a graph whose learning rate is not written after the capture
    replays the capture's rate. Its losses equal the step run eagerly up to the first loss
    that a replayed update made (the warm-up's steps, the captured one and the next), then
    part from them."""
    plan = write_plan(tmp_path, "dropout_mlp")
    eager, _ = _train_on_a_cpu(monkeypatch, tmp_path / "eager", plan, GRAPH_READY, *SCHEDULED)
    real_set = StepGraph._set

    def set_until_the_capture(graph: StepGraph, name: str, tensor: torch.Tensor, value: float) -> None:
        if name != "lr" or graph.replays == 0:
            real_set(graph, name, tensor, value)

    monkeypatch.setattr(StepGraph, "_set", set_until_the_capture)
    frozen, _ = _train_on_a_cpu(monkeypatch, tmp_path / "graphed", plan, REPLAYED, *SCHEDULED)
    unchanged = WARMUP_STEPS + 2
    assert frozen[:unchanged] == eager[:unchanged]
    assert max_relative_difference(np.array(frozen[unchanged:]), np.array(eager[unchanged:])) > 1e-3


def test_a_step_that_reads_the_device_fails_its_capture_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An op the table does not know to read the device from the host (here a clip that
    reads the gradients' norm) ends the run at the capture, saying how to train anyway."""
    from crosstrain.backends.torch import steps

    def clip_reading_the_norm(state: Any) -> None:
        if float(torch.nn.utils.clip_grad_norm_(state.module.parameters(), 1.0)) > 1e9:
            raise AssertionError("unreachable")

    monkeypatch.setattr(steps, "clip_gradients", clip_reading_the_norm)
    with pytest.raises(RuntimeError, match=r"could not be captured .* train with train\.cuda_graph = false"):
        _train_on_a_cpu(monkeypatch, tmp_path / "run", write_plan(tmp_path, "dropout_mlp"), REPLAYED)


@pytest.mark.parametrize(
    "optimizer", [("optimizer.name='adam'",), ("optimizer.name='sgd'", "optimizer.momentum=0.9")]
)
def test_a_resumed_run_replays_its_steps_as_the_uninterrupted_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, optimizer: tuple[str, ...]
) -> None:
    """Resumed from its checkpoint at step 20, a run whose steps are replayed takes the
    uninterrupted run's steps, equal: the learning rate, the step counter and the
    optimizer's state (Adam's moments and count, SGD's momentum) restored exactly before
    its capture. Exact on any CPU: both runs make the same optimizer and run the same
    step's ops on the same values (its warm-up steps eagerly, the rest replayed, which
    :func:`test_the_replayed_step_trains_as_the_graph_ready_step_run_eagerly` shows equal)."""
    plan = write_plan(tmp_path, "dropout_mlp")
    settings = (*SCHEDULED, *optimizer, "data.placement='device'", "output.checkpoint_every_steps=20")
    whole, _ = _train_on_a_cpu(monkeypatch, tmp_path / "whole", plan, REPLAYED, *settings)
    folder = tmp_path / "interrupted"
    before, _ = _train_on_a_cpu(
        monkeypatch, folder, plan, REPLAYED, *settings, "output.log_every_steps=1", fail_after=30
    )
    after, graph = _train_on_a_cpu(monkeypatch, folder, plan, REPLAYED, *settings, resume=True)
    assert (
        len(before) == 30
        and len(after) == len(whole) - 20
        and graph is not None
        and graph.replays == len(after) - WARMUP_STEPS
    )
    assert after == whole[20:]
