"""What a TorchStrategy keeps between steps (:class:`TorchState`) and the precisions it
autocasts to: the record the strategy builds and steps.py runs, in a module of its own so
that neither of those two imports the other's module.

This module imports torch only for type checking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from crosstrain.core.run.rank_usage import GpuUtilisation
from crosstrain.core.spec.plan import Plan

if TYPE_CHECKING:
    import torch

    from crosstrain.backends.torch.feed import Feed
    from crosstrain.backends.torch.graphs import StepGraph


@attrs.define
class TorchState:
    module: torch.nn.Module  # the unwrapped model: weights are read and written here
    model: torch.nn.Module  # what runs forward: DDP(module) when there are several processes
    #                         (sharded: the module itself, FSDP2's hooks on it)
    optimizer: torch.optim.Optimizer  # ZeRO-1 (train.shard = "optimizer"): zero.ShardedStateOptimizer
    scaler: torch.amp.GradScaler | None
    plan: Plan
    feed: Feed  # where the data sits and how a batch's rows reach the device
    device: str  # "cpu" or "cuda:<index>"
    processes: int = 1  # the world's processes: DDP averages each step's gradients over them
    distributed: bool = False  # in a process group: the step's sums are all-reduced
    utilisation: GpuUtilisation | None = None  # sampled while training on a GPU
    #: FSDP2 (train.shard = "full" over several processes): ``model`` is ``module`` itself,
    #: its parameters, gradients and optimizer slots DTensors holding this rank's shard
    sharded: bool = False
    optimizer_steps: int = 0  # steps applied: checkpoints record it (SGD keeps no count)
    gradient_seeds: dict[tuple[Any, ...], torch.Tensor] = attrs.field(factory=dict)
    cuda_graphs: bool = False  # the compiled model replays CUDA graphs (reduce-overhead)
    step_graph: StepGraph | None = None  # the whole eager step replayed as one CUDA graph
    #: train.compile in one process: the model's forward and the loss compiled as one
    #: (steps.CompiledLoss): (x, y, row mask, rows, step, loss mask) -> the summed loss
    compiled_loss: Callable[..., torch.Tensor] | None = None

    def gradient_seed(self, scale: float, loss: torch.Tensor) -> torch.Tensor:
        """``scale`` as a tensor beside ``loss``, made once per value (steps share a few)."""
        key = (scale, loss.dtype, loss.device)
        if key not in self.gradient_seeds:
            import torch

            self.gradient_seeds[key] = torch.full((), scale, dtype=loss.dtype, device=loss.device)
        return self.gradient_seeds[key]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, which the model's float inputs are cast to."""
        import torch

        return getattr(torch, self.plan.train.weight_dtype)  # type: ignore[no-any-return]

    def set_training(self, training: bool) -> None:
        """train()/eval() walk every submodule: only when the mode changes, not every step."""
        if self.module.training != training:
            self.model.train(training)


#: core precision -> the autocast dtype (None: none, every op in the weights' dtype, which
#: is core's ``WEIGHT_DTYPES``: float32, or float64 under fp64)
PRECISIONS: dict[str, str | None] = {"fp32": None, "bf16": "bfloat16", "fp16": "float16", "fp64": None}
