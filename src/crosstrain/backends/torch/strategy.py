"""TorchStrategy: DDP over gloo or NCCL (FSDP2 under ``train.shard = "full"``; DDP with
ZeroRedundancyOptimizer under ``"optimizer"``); plain module at world size 1.

This module imports torch only inside methods, so ``crosstrain backends`` can list
the backend (and say torch is missing) on a machine without torch.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from crosstrain.backends.torch.state import PRECISIONS, TorchState
from crosstrain.core.data.batches import Batch, Datasets, StepBatch
from crosstrain.core.errors import BackendError
from crosstrain.core.model.optimizers import DECAY_MODES
from crosstrain.core.run.job import Job, RunResult, World
from crosstrain.core.run.rank_usage import GpuUtilisation
from crosstrain.core.run.strategy import FrameworkStatus, ReduceOp
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.vocabulary import Vocabulary


def _ieee_convolutions() -> None:
    """fp32 convolutions in IEEE float32, as every other fp32 op. cuDNN computes them in TF32
    (a 10-bit mantissa) by default on Ampere and later, so its results move with the
    algorithm its heuristics pick for a layout or an address (docs/gpu.md#precision).
    Matrix products are IEEE by default; bf16 and fp16 convolutions do not read the flag."""
    import torch

    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]


def _no_buffer_sync(ddp: type) -> dict[str, Any]:
    """Every rank computes the same batch-norm statistics, so DDP need not broadcast buffers
    before each forward (``forward_sync_buffers`` from torch 2.13, ``broadcast_buffers`` before)."""
    parameters = inspect.signature(ddp).parameters
    return (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in parameters
        else {"broadcast_buffers": False}
    )


#: the ``train.shard`` modes torch trains (FSDP2 for "full", ZeroRedundancyOptimizer for
#: "optimizer": backends/torch/sharding.py)
SHARD_MODES = ("none", "optimizer", "full")
#: and why not the others (its vocabulary's refusal line): it trains every mode
UNSHARDED: dict[str, str] = {}


class TorchStrategy:
    name: ClassVar[str] = "torch"
    install_hint: ClassVar[str] = "pip install 'crosstrain[torch]'"

    def __init__(self, world: World | None = None, device: str = "cpu") -> None:
        self.world = world or World()
        self.device = device

    @classmethod
    def local(cls, device: Literal["cpu", "gpu"]) -> TorchStrategy:
        """World 1 in this process, on the CPU or the first CUDA device."""
        if device == "cpu":
            return cls(World(device="cpu"), "cpu")
        import torch

        if not torch.cuda.is_available():
            raise BackendError("--device gpu: torch sees no CUDA device")
        return cls(World(device="cuda:0"), "cuda:0")

    # ----------------------------------------------------------------- discovery and launch

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        if importlib.util.find_spec("torch") is None:
            return FrameworkStatus(importable=False, problem="No module named 'torch'")
        try:
            import torch
        except Exception as error:  # a broken install must not break `crosstrain backends`
            return FrameworkStatus(importable=False, problem=f"{type(error).__name__}: {error}")
        gpus = tuple(f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count()))
        return FrameworkStatus(importable=True, version=torch.__version__, devices=("cpu", *gpus))

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        from crosstrain.backends.torch.layers import LAYERS
        from crosstrain.backends.torch.model import LOSSES, METRIC_COUNTS
        from crosstrain.backends.torch.optimizer import OPTIMIZERS

        # every decay mode: the optimizer's groups come from core's choice (undecayed_parameters)
        return Vocabulary.of(
            LAYERS, LOSSES, OPTIMIZERS, PRECISIONS, METRIC_COUNTS, DECAY_MODES, SHARD_MODES, UNSHARDED.items()
        )

    def check_job(self, job: Job) -> None:
        from crosstrain.backends.torch.launch import check_layout

        check_layout(job)

    def spans_nodes(self) -> bool:
        """--nnodes and outside launchers (torchrun, SLURM, Kubeflow, TF_CONFIG): see launch.py."""
        return True

    def launch(self, job: Job) -> RunResult:
        from crosstrain.backends.torch.launch import launch

        return launch(job, type(self))

    # ----------------------------------------------------------------- model

    def build(self, plan: Plan, weights: Mapping[str, np.ndarray]) -> TorchState:
        import torch

        from crosstrain.backends.torch.dense import run_dropout_eagerly_when_compiled
        from crosstrain.backends.torch.graphs import StepGraph, capture_blocker
        from crosstrain.backends.torch.model import (
            build_module,
            build_sharded_module,
            load_neutral,
            undecayed_parameters,
        )
        from crosstrain.backends.torch.optimizer import make_optimizer
        from crosstrain.backends.torch.sharding import loss_scaler

        sharded = plan.train.shard == "full" and self._distributed()
        if sharded and plan.model.native is None:  # FSDP2 from the start: no rank holds it whole
            module = build_sharded_module(plan, weights, self.device, self.world.process_count)
        else:
            module = build_module(plan)
            # in the weights' dtype before they load: fp64's float64 weights are not rounded
            module.to(getattr(torch, plan.train.weight_dtype))
            if weights:
                load_neutral(module, plan, weights)
            module.to(self.device)
        model, mode = module, None
        if sharded and plan.model.native is not None:  # a native module, sharded in place
            from crosstrain.backends.torch.sharding import shard_fully

            shard_fully(module, plan, self.device, self.world.process_count)
        elif self._distributed() and not sharded:
            # DDP broadcasts rank 0's weights at construction, so native models agree too.
            device_ids = [torch.device(self.device).index] if self.device.startswith("cuda") else None
            model = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=device_ids, **_no_buffer_sync(torch.nn.parallel.DistributedDataParallel)
            )
        scaler = None
        if plan.train.precision == "fp16":
            scaler = loss_scaler(torch.device(self.device).type, sharded)
        from crosstrain.backends.torch.feed import Feed

        on_cuda = self.device.startswith("cuda")
        graphed = capture_blocker(plan, self.device, self.world.process_count) is None
        fused = (plan.train.compile and on_cuda) or graphed
        optimizer = make_optimizer(
            module,
            plan.optimizer,
            fused=fused,
            capturable=graphed,
            loss_scaled=scaler is not None,
            undecayed=undecayed_parameters(module, plan),
            sharded_state=plan.train.shard == "optimizer" and self._distributed(),
        )
        if plan.train.compile:
            mode = self._compile_mode(plan)
            run_dropout_eagerly_when_compiled()
        if plan.train.compile and self._distributed():
            # DDP first, then compile: dynamo splits the graph at DDP's bucket boundaries so
            # the gradient all-reduce still overlaps the backward
            model = torch.compile(model, mode=mode)  # type: ignore[assignment]
        utilisation = None
        if on_cuda:
            _ieee_convolutions()
            torch.cuda.reset_peak_memory_stats(self.device)
            device = torch.device(self.device)
            # torch maps its device index to NVML's (CUDA_VISIBLE_DEVICES); needs pynvml
            utilisation = GpuUtilisation(lambda: torch.cuda.utilization(device)).start()
        state = TorchState(
            module, model, optimizer, scaler, plan, Feed(self.device), self.device,
            self.world.process_count, self._distributed(), utilisation, sharded,
        )  # fmt: skip
        state.cuda_graphs = mode == "reduce-overhead"
        if plan.train.compile and not self._distributed():  # one process: the loss compiled too
            from crosstrain.backends.torch.steps import CompiledLoss

            state.compiled_loss = torch.compile(CompiledLoss(state), mode=mode)
        if graphed:
            state.step_graph = StepGraph(torch.device(self.device), optimizer.param_groups[0]["lr"])
        return state

    def _compile_mode(self, plan: Plan) -> str | None:
        """torch.compile's mode: on one CUDA process without accumulation, "reduce-overhead"
        (the compiled forward and backward replayed as CUDA graphs: a small model's step is
        otherwise bound by the host launching its kernels); else the default. Each step's
        forward and backward then replay once, so a graph's outputs (gradients among them)
        are consumed before the next replay overwrites them; several micro-batches, or
        DDP's hooks between the graphs, would break that."""
        graphs = self.device.startswith("cuda") and not self._distributed()
        return "reduce-overhead" if graphs and plan.train.grad_accum_steps == 1 else None

    def place_data(self, state: TorchState, datasets: Datasets) -> None:
        state.feed.place(state.plan, datasets)

    def prefetch(self, state: TorchState, step: StepBatch) -> None:
        state.feed.prefetch(step.micro_batches)

    # ----------------------------------------------------------------- steps (steps.py)

    def train_step(self, state: TorchState, step: StepBatch, lr: float) -> dict[str, Any]:
        from crosstrain.backends.torch.steps import train_step

        return train_step(state, step, lr)

    def resolve_metrics(self, pending: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        from crosstrain.backends.torch.steps import resolve_metrics

        return resolve_metrics(pending)

    def eval_step(self, state: TorchState, batch: Batch) -> dict[str, float]:
        from crosstrain.backends.torch.steps import eval_step

        return eval_step(state, batch)

    def predict(self, state: TorchState, x: np.ndarray) -> np.ndarray:
        from crosstrain.backends.torch.steps import predict

        return predict(state, x)

    def export_formats(self) -> tuple[str, ...]:
        return ("torch",)

    def export(self, state: TorchState, format_name: str, out: Path, sample: np.ndarray) -> list[Path]:
        from crosstrain.backends.torch.export import export_torch

        return export_torch(state.module, state.plan.data.scaling, out, sample)

    def device_report(self, state: TorchState) -> dict[str, float | None]:
        import torch

        if not self.device.startswith("cuda"):
            return {}  # on a CPU the host's peak memory (always reported) is the device's
        return {
            "peak_device_memory_bytes": float(torch.cuda.max_memory_allocated(self.device)),
            "gpu_utilisation_percent": state.utilisation.stop() if state.utilisation else None,
            # steps replayed as one CUDA graph (train.cuda_graph; 0: every kernel launched)
            "cuda_graph_steps": float(state.step_graph.replays if state.step_graph else 0),
        }

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, values: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        import torch
        import torch.distributed as dist

        if not self._distributed():
            return values
        tensor = torch.as_tensor(np.asarray(values), device=self.device).clone()
        reduce_op = {
            "sum": dist.ReduceOp.SUM,
            "mean": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]
        dist.all_reduce(tensor, op=reduce_op)
        if op == "mean":
            tensor = tensor / self.world.process_count
        return np.asarray(tensor.cpu().numpy())

    def broadcast(self, values: np.ndarray, src: int = 0) -> np.ndarray:
        import torch
        import torch.distributed as dist

        if not self._distributed():
            return values
        tensor = torch.as_tensor(np.asarray(values), device=self.device).clone()
        dist.broadcast(tensor, src=src)
        return np.asarray(tensor.cpu().numpy())

    def barrier(self) -> None:
        import torch.distributed as dist

        if self._distributed():
            dist.barrier()

    # ----------------------------------------------------------------- weights

    def state_dict(self, state: TorchState) -> Mapping[str, np.ndarray]:
        from crosstrain.backends.torch.model import neutral_state

        return neutral_state(state.module, state.plan)

    def load_state_dict(self, state: TorchState, tensors: Mapping[str, np.ndarray]) -> None:
        from crosstrain.backends.torch.model import load_neutral

        load_neutral(state.module, state.plan, tensors)

    def optimizer_state(self, state: TorchState) -> Mapping[str, np.ndarray]:
        from crosstrain.backends.torch.model import neutral_parameters
        from crosstrain.backends.torch.optimizer import neutral_optimizer_state

        scalars = {}
        if state.scaler is not None:
            scaler = state.scaler.state_dict()
            scalars["loss_scale.scale"] = np.asarray(scaler["scale"], np.float64)
            scalars["loss_scale.growth_tracker"] = np.asarray(scaler["_growth_tracker"], np.int64)
        parameters = neutral_parameters(state.module, state.plan)
        return neutral_optimizer_state(state.optimizer, parameters, state.optimizer_steps, scalars)

    def load_optimizer_state(self, state: TorchState, tensors: Mapping[str, np.ndarray]) -> None:
        from crosstrain.backends.torch.model import neutral_parameters
        from crosstrain.backends.torch.optimizer import load_neutral_optimizer_state

        parameters = neutral_parameters(state.module, state.plan)
        state.optimizer_steps = load_neutral_optimizer_state(state.optimizer, parameters, tensors)
        if state.scaler is not None and "loss_scale.scale" in tensors:
            scaler = state.scaler.state_dict()
            scaler["scale"] = float(tensors["loss_scale.scale"])
            scaler["_growth_tracker"] = int(tensors.get("loss_scale.growth_tracker", 0))
            state.scaler.load_state_dict(scaler)

    def memory_held(self, state: TorchState) -> dict[str, int]:
        from crosstrain.backends.torch.sharding import memory_held

        return memory_held(state)

    def skips_nonfinite_steps(self) -> bool:
        return True

    def restarts_workers(self) -> bool:
        """The elastic agent restarts the group (LaunchConfig.max_restarts); under an outside
        torchrun, torchrun's own ``--max-restarts`` does, and the restarted workers resume."""
        return True

    # ----------------------------------------------------------------- helpers

    def _distributed(self) -> bool:
        import torch.distributed as dist

        return self.world.process_count > 1 and dist.is_initialized()
