"""The largest micro-batch that fits a GPU, found by running the plan: a few steps at a
micro-batch, doubled until a run fails out of memory, then halved back between the last
that fit and the first that did not. Each probe is a run of its own processes, so a failed
one frees all it held (no allocator cache survives it). The plan's ``global_batch_size``
is then kept by ``train.grad_accum_steps``, so its curve stays the same."""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

#: what the frameworks' out-of-memory errors say (torch, tf/XLA, jax)
OUT_OF_MEMORY = (
    "out of memory",
    "outofmemory",
    "resource_exhausted",
    "resource exhausted",
    "oom when allocating",
)
#: steps a probe runs: the first steps allocate what every later step reuses
PROBE_STEPS = 3
#: the bisection stops within this fraction of the answer (the micro-batch must divide the
#: global batch anyway: a few rows more would rarely change the split)
BISECT_TO = 16


def is_out_of_memory(message: str) -> bool:
    lowered = message.lower()
    return any(words in lowered for words in OUT_OF_MEMORY)


@attrs.frozen
class BatchFit:
    """The largest micro-batch per replica that ran, and the split of the global batch."""

    largest: int
    micro_batch: int
    grad_accum_steps: int


def largest_micro_batch(start: int, fits: Callable[[int], bool], ceiling: int) -> int:
    """The largest micro-batch up to ``ceiling`` for which ``fits`` holds: from ``start``,
    doubled while it fits, then bisected between the last that fit and the first that did
    not, to within 1/BISECT_TO of it; 0 when not even 1 fits."""
    low, high = 0, ceiling + 1
    size = min(max(1, start), ceiling)
    while size < high:
        if not fits(size):
            high = size
            break
        low = size
        size = min(size * 2, ceiling) if size < ceiling else high
    while high - low > max(1, low // BISECT_TO):
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def split_global_batch(global_batch: int, replicas: int, largest: int) -> BatchFit:
    """The fewest accumulation steps whose micro-batch fits: ``global_batch`` = replicas x
    accumulation x micro-batch, each a whole number."""
    per_replica = global_batch // replicas
    for accumulation in range(max(1, math.ceil(per_replica / largest)), per_replica + 1):
        if per_replica % accumulation == 0:
            return BatchFit(largest, per_replica // accumulation, accumulation)
    return BatchFit(largest, 1, per_replica)
