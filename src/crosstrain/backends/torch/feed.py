"""Where the torch backend keeps the data, and how a batch's rows reach the model.

Core decides which rows form each step (the sampler); this module decides where they are
read. Placed on the device (``data.placement = "device"``, or ``"auto"`` on a GPU when the
arrays fit in :data:`~crosstrain.backends.common.AUTO_SHARE` of its free memory), each
array is copied there once and a step's rows are gathered there by an index tensor: no
host gather, no per-step copy of the rows. Otherwise the rows are gathered on the host and
copied each step; on a GPU the next step's rows are gathered by a background thread into
pinned memory and copied on a side stream while the current step computes
(:meth:`Feed.prefetch`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from crosstrain.backends.common import should_place, unplaceable
from crosstrain.core.data import Batch, Datasets, Rows
from crosstrain.core.mapped import MappedRows
from crosstrain.core.plan import Plan
from crosstrain.core.scaling import InputScaling, ScaledRows
from crosstrain.core.tokens import TokenWindows

#: dtypes torch indexes natively; other integer token arrays are widened to int32 once
_TORCH_DTYPES = (np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64)

Gather = Callable[[torch.Tensor], torch.Tensor]


class Feed:
    """Turns a batch into tensors on the device, from placed arrays when it has them."""

    def __init__(self, device: str, timeout_seconds: float = 300.0) -> None:
        self.device = torch.device(device)
        self.timeout_seconds = timeout_seconds
        self._placed: dict[int, tuple[Gather, Gather]] = {}  # id(dataset) -> gathers of x, y
        self._prefetcher: _Prefetcher | None = None

    @property
    def placed(self) -> bool:
        return bool(self._placed)

    def place(self, plan: Plan, datasets: Datasets) -> None:
        """Copy the data sets to the device when the plan's placement says so."""
        parts = [part for part in (datasets.train, datasets.eval) if part is not None]
        on_gpu = self.device.type == "cuda"
        if not should_place(plan, parts, self._free_bytes if on_gpu else None):
            return
        on_device: dict[int, torch.Tensor] = {}  # one copy of an array shared by parts
        for part in parts:
            self._placed[id(part)] = (
                self._gatherer(part.x, on_device),
                self._gatherer(part.y, on_device),
            )

    def prefetch(self, batches: Iterable[Batch]) -> None:
        """Start gathering and copying the batches' rows (a GPU, rows on the host); a later
        :meth:`tensors` of the same batch waits for them instead of doing the work."""
        if self.device.type != "cuda":
            return  # on a CPU there is no copy to overlap: the host is the device
        for batch in batches:
            if batch.source is None or id(batch.source.dataset) not in self._placed:
                if self._prefetcher is None:
                    self._prefetcher = _Prefetcher(self.device, self.timeout_seconds)
                self._prefetcher.submit(batch)

    def tensors(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """x, y, weight and rows of the batch, on the device."""
        if self._prefetcher is not None:
            prefetched = self._prefetcher.take(batch)
            if prefetched is not None:
                return prefetched
        source = batch.source
        if source is not None and id(source.dataset) in self._placed:
            # one small host-to-device copy a step: row indices, positions and the row mask
            packed = torch.from_numpy(np.stack([source.indices, batch.rows, batch.weight.astype(np.int64)]))
            if self.device.type == "cuda":
                # from pageable memory a copy waits for the stream to drain, so the host
                # could never run ahead of the GPU; from pinned memory it is queued
                packed = packed.pin_memory()
            indices, rows, mask = packed.to(self.device, non_blocking=True)
            gather_x, gather_y = self._placed[id(source.dataset)]
            return gather_x(indices), gather_y(indices), mask.to(torch.float32), rows
        weight = torch.from_numpy(batch.weight).to(self.device, non_blocking=True)
        rows = torch.from_numpy(batch.rows).to(self.device, non_blocking=True)
        x = torch.from_numpy(batch.x).to(self.device, non_blocking=True)
        y = torch.from_numpy(batch.y).to(self.device, non_blocking=True)
        return x, y, weight, rows

    # ----------------------------------------------------------------- placement

    def _free_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def _gatherer(self, rows: Rows, on_device: dict[int, torch.Tensor]) -> Gather:
        if isinstance(rows, ScaledRows):
            return _scaled_gather(self._gatherer(rows.raw, on_device), rows.scaling, self.device)
        if isinstance(rows, TokenWindows):
            return _window_gather(rows, self._to_device(rows.tokens, on_device))
        if isinstance(rows, MappedRows):
            return self._mapped_gather(rows, on_device)
        if not isinstance(rows, np.ndarray):
            raise unplaceable(rows)
        return self._to_device(rows, on_device).__getitem__

    def _to_device(self, array: np.ndarray, on_device: dict[int, torch.Tensor]) -> torch.Tensor:
        key = id(array)
        if key not in on_device:
            host = np.ascontiguousarray(
                array if array.dtype.type in _TORCH_DTYPES else array.astype(np.int32)
            )
            with warnings.catch_warnings():  # a read-only memory map: rows are only ever read
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                on_device[key] = torch.from_numpy(host).to(self.device)
        return on_device[key]

    def _mapped_gather(self, rows: MappedRows, on_device: dict[int, torch.Tensor]) -> Gather:
        """Rows of a memory-mapped file, copied to the device in the file's dtype (uint8 images
        stay uint8 until here) and in this view's row order and shape; a step's rows are then
        one index away, cast there when the model takes another dtype."""
        array = self._to_device(rows.array, on_device)
        if rows.index is not None:
            array = array[torch.from_numpy(rows.index).to(self.device)]
        array = array.reshape(len(array), *rows.row_shape)
        dtype = getattr(torch, rows.dtype.name)
        if array.dtype == dtype:
            return array.__getitem__
        return lambda indices: array[indices].to(dtype)


class _Prefetcher:
    """One background thread that gathers a batch's rows on the host (numpy releases the GIL
    while it copies), pins them and copies them to the GPU on a side stream. The step's
    stream waits for that copy's event, never for the host."""

    def __init__(self, device: torch.device, timeout_seconds: float) -> None:
        self.device, self.timeout_seconds = device, timeout_seconds
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crosstrain-prefetch")
        self.pending: dict[int, tuple[Batch, Future[tuple[tuple[torch.Tensor, ...], torch.cuda.Event]]]] = {}

    def submit(self, batch: Batch) -> None:
        self.pending[id(batch)] = (batch, self.pool.submit(self._copy, batch))

    def take(self, batch: Batch) -> tuple[torch.Tensor, ...] | None:
        entry = self.pending.pop(id(batch), None)
        if entry is None or entry[0] is not batch:
            return None
        try:
            tensors, copied = entry[1].result(timeout=self.timeout_seconds)
        except TimeoutError:
            raise TimeoutError(
                f"reading a batch's rows took more than {self.timeout_seconds:.0f} s"
            ) from None
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)
        for tensor in tensors:  # made on the side stream, used on this one
            tensor.record_stream(stream)
        return tensors

    def _copy(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
        host = [batch.x, batch.y, batch.weight, batch.rows]  # the host gather, in this thread
        pinned = [torch.from_numpy(np.ascontiguousarray(array)).pin_memory() for array in host]
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            x, y, weight, rows = (tensor.to(self.device, non_blocking=True) for tensor in pinned)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self.stream)
        return (x, y, weight, rows), copied


_TORCH_OPERATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mul": torch.mul,
    "sub": torch.sub,
    "div": torch.div,
}


def _scaled_gather(raw: Gather, scaling: InputScaling, device: torch.device) -> Gather:
    """The raw rows (uint8 images stay uint8 until here), scaled on the device by the same
    float32 operations, in the same order, as core's numpy reference."""
    steps = [
        (_TORCH_OPERATIONS[operation], torch.from_numpy(operand).to(device))
        for operation, operand in scaling.steps()
    ]

    def gather(indices: torch.Tensor) -> torch.Tensor:
        x = raw(indices).to(torch.float32)
        for operation, operand in steps:
            x = operation(x, operand)
        return x

    return gather


def _window_gather(windows: TokenWindows, tokens: torch.Tensor) -> Gather:
    """Row i of the windows, read from the placed token array: tokens[(first+i)*L + offset + k]."""
    offsets = torch.arange(windows.length, device=tokens.device) + windows.offset
    dtype = getattr(torch, windows.dtype.name)

    def gather(indices: torch.Tensor) -> torch.Tensor:
        starts = (indices + windows.first) * windows.length
        return tokens[starts[:, None] + offsets[None, :]].to(dtype)

    return gather
