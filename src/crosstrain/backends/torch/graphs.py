"""The whole training step replayed as one CUDA graph.

A small model's eager step on a GPU is bound by the host: Python launches some fifty
kernels (forward, backward, the optimizer's update) and the GPU finishes each before the
next arrives. Captured once, the step is one graph launch: the gather of the batch's rows
from placed arrays, the forward and the backward (of every micro-batch, under gradient
accumulation) and the optimizer's update all replay from
fixed addresses, and per step the host only copies in what changed (the row indices, the
learning rate) and queues the replay.

What a replay needs, and why some steps are not captured (:func:`capture_blocker`):
the shapes never change (core pads the last batch, so they do not), nothing in the step
reads the device from the host (fp16's loss scaler and ``on_nonfinite = "skip"`` do), the
optimizer takes its learning rate and step count from the device (torch's Adam and AdamW
with ``capturable=True``; torch's SGD, which has no such flag, in its fused kernel, which
reads a tensor learning rate on the device), one process (DDP's gradient hooks run on the
host between kernels), and every op can be captured
(``nn.Embedding``'s backward sorts its indices with a host sync, so a model with an
embedding is launched kernel by kernel).
``train.compile`` has its own graphs (``mode="reduce-overhead"``). The first steps run
eagerly on a side stream (torch's recipe: the optimizer's state and cuBLAS's workspaces are
made outside the capture); they are real steps, as are the replays.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from crosstrain.backends.torch.feed import Finish
from crosstrain.backends.torch.layers import LAYERS
from crosstrain.core.spec.plan import Plan

#: real steps run eagerly (on a side stream) before the capture
WARMUP_STEPS = 2

#: one micro-batch: what the step copies in for it, and how the graph makes its x, y, row
#: mask and row positions of those tensors (gathered from placed arrays, or as they are)
MicroBatch = tuple[tuple[torch.Tensor, ...], Finish]
#: every micro-batch's (x, y, row mask, row positions) and the step counter -> the step's
#: summed loss (forward and backward of every micro-batch, then the optimizer's update)
Update = Callable[[list[tuple[torch.Tensor, ...]], torch.Tensor], torch.Tensor]


class Replayable(Protocol):
    """A captured step: :class:`torch.cuda.CUDAGraph`, or a test's stand-in on a CPU."""

    def replay(self) -> None: ...


def capture_blocker(plan: Plan, device: str, processes: int) -> str | None:
    """Why this plan's step is not replayed as a CUDA graph on ``device``; None: it is."""
    train = plan.train
    reasons = (
        (not train.cuda_graph, "train.cuda_graph is false"),
        (not device.startswith("cuda"), "not on a GPU"),
        (train.compile, "train.compile replays its own graphs"),
        (processes > 1, "several processes (DDP)"),
        (train.precision == "fp16", "fp16's loss scaler reads the device"),
        # a captured Adam is fused and reads its learning rate as a float32 tensor: under
        # fp64 that rounds every update's step size (and fp64 GPU steps are slow anyway)
        (train.precision == "fp64", "fp64: a captured update reads its learning rate in float32"),
        (train.on_nonfinite == "skip", 'on_nonfinite = "skip" reads the device'),
        (plan.model.native is not None, "a native model"),
    )
    for blocked, reason in reasons:
        if blocked:
            return reason
    for node in plan.model.graph().nodes:  # a layer type with an op that cannot be captured
        uncapturable = LAYERS[node.layer.type].uncapturable
        if uncapturable is not None:
            return uncapturable
    return None


def _made_of(
    micro_batches: Sequence[MicroBatch], tensors: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, ...]]:
    """Each micro-batch's (x, y, row mask, row positions), made by its finish of its share of
    ``tensors`` (what the step copied in, every micro-batch's in a row)."""
    made, start = [], 0
    for held, finish in micro_batches:
        made.append(finish(*tensors[start : start + len(held)]))
        start += len(held)
    return made


class StepGraph:
    """One process's training step as a CUDA graph: warmed up, captured at the first step
    after the warm-up, replayed from then on. The learning rate, the gradient's seed (the
    loss scale) and the step counter dropout reads live on the device; the host writes
    them only when they change."""

    def __init__(self, device: torch.device, lr: torch.Tensor) -> None:
        self.device = device
        self.lr = lr  # the optimizer's own: its update reads it from the device
        self.seed = torch.ones((), dtype=torch.float32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self._values: dict[str, float] = {"lr": float("nan"), "seed": float("nan"), "step": -1.0}
        self.warm_steps = 0
        self.replays = 0
        self._graph: Replayable | None = None
        self._inputs: list[torch.Tensor] = []  # what the graph reads
        self._sources: list[torch.Tensor] = []  # what was last copied into them
        self._loss: torch.Tensor | None = None  # where the graph writes the step's loss

    def run(
        self,
        update: Update,
        micro_batches: Sequence[MicroBatch],
        lr: float,
        seed: float,
        step: int,
    ) -> torch.Tensor:
        """One training step; its summed loss, a tensor of its own (the next replay
        overwrites the graph's)."""
        self._set("lr", self.lr, lr)
        self._set("seed", self.seed, seed)
        self._set("step", self.step, step)
        self._values["step"] += 1  # the step increments its counter on the device
        sources = [source for held, _ in micro_batches for source in held]
        if self._graph is None and self.warm_steps < WARMUP_STEPS:
            return self._warm_up(update, _made_of(micro_batches, sources))
        if self._graph is None:
            self._capture(update, sources, micro_batches)
        else:
            self._copy_in(sources)
        assert self._graph is not None and self._loss is not None
        self._graph.replay()
        self.replays += 1
        return self._loss.clone()

    @property
    def captures_next(self) -> bool:
        """Whether the next step is captured: no other thread may then use the device."""
        return self._graph is None and self.warm_steps >= WARMUP_STEPS

    def _set(self, name: str, tensor: torch.Tensor, value: float) -> None:
        if self._values[name] != value:  # one small launch, when the value changes
            tensor.fill_(value)
            self._values[name] = value

    def _warm_up(self, update: Update, inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        with warnings.catch_warnings():
            # torch warns that a capturable optimizer steps outside a capture: these do
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            loss = self._on_side_stream(lambda: update(inputs, self.step))
        self.warm_steps += 1
        return loss

    def _on_side_stream(self, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``work`` on a side stream, as torch's recipe warms up a capture, ordered after
        and before the current stream's work."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = work()
        current.wait_stream(side)
        result.record_stream(current)
        return result

    def _capture(
        self, update: Update, sources: list[torch.Tensor], micro_batches: Sequence[MicroBatch]
    ) -> None:
        self._inputs = [source.clone() for source in sources]
        self._sources = sources
        try:
            # the rows are made inside the capture: a placed batch's gather replays each step
            self._graph, self._loss = self._record(
                lambda: update(_made_of(micro_batches, self._inputs), self.step)
            )
        except RuntimeError as error:  # an op this table does not know reads the device
            raise RuntimeError(
                f"the training step could not be captured as one CUDA graph ({error}); "
                "train with train.cuda_graph = false"
            ) from error

    def _record(self, work: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """``work`` captured, not run: the graph and where its replays write the result."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = work()
        return graph, result

    def _copy_in(self, sources: Sequence[torch.Tensor]) -> None:
        """Copy what changed into the graph's inputs: a step's row indices or rows (new
        tensors), not the cached row mask and positions a full batch shares (the same ones)."""
        if len(sources) != len(self._inputs):
            raise RuntimeError("a step's inputs differ from those its CUDA graph was captured with")
        for index, (source, held) in enumerate(zip(sources, self._inputs, strict=True)):
            if source is self._sources[index]:
                continue
            if source.shape != held.shape or source.dtype != held.dtype:
                raise RuntimeError(
                    f"a step's input {index} is {source.dtype} {tuple(source.shape)}, "
                    f"its CUDA graph's {held.dtype} {tuple(held.shape)}"
                )
            held.copy_(source, non_blocking=True)
            self._sources[index] = source
