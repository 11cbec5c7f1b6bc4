"""``train.shard`` on torch: ``"full"``, FSDP2 (``torch.distributed.fsdp.fully_shard``);
``"optimizer"``, ZeRO-1 under DDP (backends/torch/zero.py).

``"full"``:

Each rank holds 1/N of every parameter (dim 0, torch.chunk's split), of its gradient and
of the optimizer's slots, as DTensors over a one-dimensional DeviceMesh of the world (gloo
on CPUs, NCCL on GPUs). The units gathered whole for a forward and a backward are the
graph's block repeats (:meth:`crosstrain.core.model.graph.Graph.block_repeats`), each
repeat one unit; everything outside them (embeddings, the output layer and the weights tied
to them) is the root's unit, which stays gathered from the forward through the backward.

What it computes is what DDP computes: FSDP2 averages each gradient over the ranks (a
reduce-scatter) as DDP does (an all-reduce), so the step's loss keeps DDP's scale; the
forward runs under the same autocast (no ``MixedPrecisionPolicy``: its bf16 parameters
would round differently from autocast's per-op casts); the norm ``clip_grad_norm`` clips
to is the global one (``torch.nn.utils.clip_grad_norm_`` sums the shards' squares);
fp16's loss scaler agrees over the ranks whether a step overflowed (:func:`loss_scaler`);
``train.compile`` compiles the sharded module, FSDP2's gathers and reduce-scatters traced
between the compiled parts. At world 1 a plan sharded "full" runs the plain module: one
rank's shard is everything, and sharding costs nothing where it cannot help.

``"optimizer"``: DDP as for ``"none"``, and the optimizer's state split over the ranks
(:class:`crosstrain.backends.torch.zero.ShardedStateOptimizer`). At world 1 it is the
plain optimizer.

DTensor's module takes half a second to import: nothing here imports it until a run shards
(:func:`is_sharded` asks only once it is loaded).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from crosstrain.core.spec.plan import Plan

if TYPE_CHECKING:
    from crosstrain.backends.torch.state import TorchState


def shard_fully(module: nn.Module, plan: Plan, device: str, processes: int) -> None:
    """FSDP2 over the world: each block repeat its own unit, then the root. A native model
    (its own modules, no graph) is one unit, and its ranks start from rank 0's weights, as
    DDP's broadcast gives them (a neutral model's are seeded alike on every rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (processes,))
    # FSDP2 shards contiguous parameters only: convolution kernels leave channels-last
    # (the images between them stay channels-last; the kernels' layout changes no value)
    module.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    if plan.model.native is not None:
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor, src=0)
    else:
        nodes = module.nodes
        assert isinstance(nodes, nn.ModuleDict)
        for repeat in plan.model.graph().block_repeats():
            units = [nodes[node.path.replace(".", "/")] for node in repeat]
            # every node of the repeat, not only those with weights: the group is gathered
            # from the first one's forward until the last one's ends
            if any(True for unit in units for _ in unit.parameters()):
                fully_shard(units, mesh=mesh)
    fully_shard(module, mesh=mesh)


def loss_scaler(device_type: str, sharded: bool) -> torch.amp.GradScaler:
    """fp16's loss scaler. Sharded "full", each rank unscales only its shards' gradients,
    so an overflow one rank finds must skip every rank's step: FSDP's scaler all-reduces
    the found-overflow flag before the step (DDP's ranks all hold the whole averaged
    gradients, so they agree without it)."""
    if not sharded:
        return torch.amp.GradScaler(device_type)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's shards); False, without importing DTensor,
    in a process that never loaded it (so never sharded)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard; any other tensor whole."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole on every rank: a DTensor gathered from its shards (a collective that
    every rank makes, in the same order), any other tensor as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor every rank holds) laid out as ``like``: a DTensor of the
    same mesh and placements, each rank keeping its own shard (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(device=like.device, dtype=like.dtype),
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        src_data_rank=None,
    )


def copy_whole(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole tensor into ``target``: into its local shard when it is sharded."""
    if is_sharded(target):
        local(target).copy_(local(sharded_like(value, target)))
    else:
        target.copy_(value)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch.optim optimizer that updates this rank's parameters and holds their state:
    a ZeRO-1 optimizer's local one (backends/torch/zero.py); any other optimizer itself."""
    return getattr(optimizer, "local", optimizer)


def memory_held(state: TorchState) -> dict[str, int]:
    """The bytes this rank holds (local shards only): the parameters, a gradient for each
    trainable one (in its dtype; gradients are freed between steps, so counted from the
    parameters they match), and every tensor of the optimizer's state (ZeRO-1: the local
    optimizer's, of the parameters this rank updates)."""
    parameters = list(state.module.parameters())
    slots = [value for entry in local_optimizer(state.optimizer).state.values() for value in entry.values()]
    optimizer = [value for value in slots if torch.is_tensor(value)]
    return {
        "parameters": sum(_bytes(param) for param in parameters),
        "gradients": sum(_bytes(param) for param in parameters if param.requires_grad),
        "optimizer": sum(_bytes(value) for value in optimizer),
    }


def _bytes(tensor: torch.Tensor) -> int:
    part = local(tensor)
    return part.numel() * part.element_size()
