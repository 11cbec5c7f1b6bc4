"""Where the torch backend keeps the data, and how a batch's rows reach the model.

Core decides which rows form each step (the sampler); this module decides where they are
read. Placed on the device (``data.placement = "device"``, or ``"auto"`` on a GPU when the
arrays fit in :data:`~crosstrain.backends.placement.AUTO_SHARE` of its free memory), each
array is copied there once and a step's rows are gathered there by an index tensor: no
host gather, no per-step copy of the rows. Otherwise the rows are gathered on the host and
copied each step; on a GPU as their data set stores them (a file's uint8 images stay
uint8), cast and scaled there, and the next step's rows are gathered by background threads
into pinned staging buffers and copied on a side stream while the current step computes
(:meth:`Feed.prefetch`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
import torch

from crosstrain.backends.placement import Placing, should_place
from crosstrain.backends.prefetch import PREFETCH_TIMEOUT_SECONDS, Prefetched
from crosstrain.core.data.batches import Batch, Datasets, epoch_slice
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.rows import image_rows, input_scaling, stored_rows, translate
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.data.sources.images import ImageReading
from crosstrain.core.data.tokens import TokenWindows
from crosstrain.core.spec.plan import Plan

#: dtypes torch indexes natively; other integer token arrays are widened to int32 once
_TORCH_DTYPES = (np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64)

Gather = Callable[[torch.Tensor], torch.Tensor]
#: the tensors a CUDA graph copies in -> x, y, row mask and row positions, inside the graph
Finish = Callable[..., tuple[torch.Tensor, ...]]


def _as_they_are(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


class Feed:
    """Turns a batch into tensors on the device, from placed arrays when it has them."""

    def __init__(self, device: str, timeout_seconds: float = PREFETCH_TIMEOUT_SECONDS) -> None:
        self.device = torch.device(device)
        self.timeout_seconds = timeout_seconds
        self._placed: dict[int, tuple[Gather, Gather]] = {}  # id(dataset) -> gathers of x, y
        self._prefetcher: _Prefetcher | None = None
        self._masks: dict[int, torch.Tensor] = {}  # rows -> a mask of ones
        self._runs: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]] = {}  # row positions
        self._order: tuple[np.ndarray, torch.Tensor] | None = None  # the epoch's order, both sides
        #: (dtype, scaling) -> how rows from the host become the model's, on the device
        self._converters: dict[tuple[np.dtype[Any], InputScaling | None], Convert] = {}

    @property
    def placed(self) -> bool:
        return bool(self._placed)

    def place(self, plan: Plan, datasets: Datasets) -> None:
        """Copy the data sets to the device when the plan's placement says so."""
        parts = [part for part in (datasets.train, datasets.eval) if part is not None]
        on_gpu = self.device.type == "cuda"
        if not should_place(plan, parts, self._free_bytes if on_gpu else None):
            return
        gathers = _DeviceGathers(self.device)
        for part in parts:
            self._placed[id(part)] = (translate(part.x, gathers), translate(part.y, gathers))

    def prefetch(self, batches: Iterable[Batch]) -> None:
        """Start gathering and copying the batches' rows (a GPU, rows on the host); a later
        :meth:`tensors` of the same batch waits for them instead of doing the work."""
        if self.device.type != "cuda":
            return  # on a CPU there is no copy to overlap: the host is the device
        for batch in batches:
            if batch.source is None or id(batch.source.dataset) not in self._placed:
                if self._prefetcher is None:
                    self._prefetcher = _Prefetcher(self.device, self.timeout_seconds)
                self._prefetcher.submit(batch, self._x_converter(batch))

    def tensors(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """x, y, weight and rows of the batch, on the device."""
        if self._prefetcher is not None:
            prefetched = self._prefetcher.take(batch)
            if prefetched is not None:
                return prefetched
        placed = self._placed_sources(batch)
        if placed is not None:
            sources, gather = placed
            return gather(*sources)
        weight = torch.from_numpy(batch.weight).to(self.device, non_blocking=True)
        rows = torch.from_numpy(batch.rows).to(self.device, non_blocking=True)
        y = torch.from_numpy(batch.y).to(self.device, non_blocking=True)
        if self.device.type == "cpu":
            # the host is the device: no copy to shrink, and numpy's conversion faults in
            # fewer pages than torch's (docs/performance.md#measurements-behind-the-code)
            return torch.from_numpy(batch.x), y, weight, rows
        stored, dtype, scaling = batch.stored_x()
        x = torch.from_numpy(torch_compatible(stored)).to(self.device, non_blocking=True)
        return self.converter(dtype, scaling)(x), y, weight, rows

    def settle(self) -> None:
        """Wait until the background copies already asked for are done (a CUDA graph's
        capture forbids other threads' device calls while it lasts)."""
        if self._prefetcher is not None:
            self._prefetcher.settle()

    def graph_sources(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], Finish]:
        """What a step replayed as a CUDA graph copies in, and what the graph makes of it:
        from placed arrays the row indices, mask and positions (the rows are gathered inside
        the graph); from the host the rows themselves (copied and converted before)."""
        return self._placed_sources(batch) or (self.tensors(batch), _as_they_are)

    def _placed_sources(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], Finish] | None:
        """A batch of placed arrays as its row indices, mask and positions on the device, and
        the gather of its rows from them; None when its rows are not placed."""
        source = batch.source
        if source is None or id(source.dataset) not in self._placed:
            return None
        gather_x, gather_y = self._placed[id(source.dataset)]
        indices, weight = self._indices_and_mask(source.indices, batch.weight)

        def gather(
            indices: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            return gather_x(indices), gather_y(indices), weight, rows

        return (indices, weight, self._positions(batch.rows)), gather

    def _x_converter(self, batch: Batch) -> Convert | None:
        """The conversion of a batch's x rows as stored (None: they are read as x is)."""
        if batch.source is None:
            return None
        rows = batch.source.dataset.x
        return self.converter(rows.dtype, input_scaling(rows))

    def converter(self, dtype: np.dtype[Any], scaling: InputScaling | None) -> Convert:
        """Stored rows on the device -> the model's rows: cast to ``dtype``, then scaled (made
        once per conversion: a scaling's operands are copied to the device)."""
        key = (dtype, scaling)
        if key not in self._converters:
            self._converters[key] = _converter(dtype, scaling, self.device)
        return self._converters[key]

    def _indices_and_mask(self, indices: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A placed batch's row indices and row mask on the device. A full batch is a slice
        of the epoch's order, copied to the device once an epoch: its indices are a view
        there, and its mask the cached ones (no copy, no launch a step). A padded batch
        copies its indices and mask, in one small host-to-device copy."""
        in_order = epoch_slice(indices) if mask.all() else None
        if in_order is not None:
            order, start = in_order
            if self._order is None or self._order[0] is not order:
                self._order = (order, torch.from_numpy(order).to(self.device))
            return self._order[1][start : start + len(indices)], self._ones(len(mask))
        packed = torch.from_numpy(np.stack([indices.astype(np.int64), mask.astype(np.int64)]))
        if self.device.type == "cuda":
            # from pageable memory a copy waits for the stream to drain, so the host could
            # never run ahead of the GPU; from pinned memory it is queued. A block of the
            # caching host allocator (reused only after its copy is done), filled here:
            # pin_memory() would first ask the driver whether the rows are pinned
            pinned = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            packed = pinned.copy_(packed)
        packed = packed.to(self.device, non_blocking=True)
        return packed[0], packed[1].to(torch.float32)

    def _positions(self, rows: np.ndarray) -> torch.Tensor:
        """A batch's row positions on the device. Core's shards are contiguous, so they are
        one of a few runs ``first, first + 1, ...`` that recur every step: each run is copied
        once (anything else, each time)."""
        key = (int(rows[0]) if len(rows) else 0, len(rows))
        if key not in self._runs:
            run = np.arange(key[0], key[0] + key[1], dtype=np.int64)
            self._runs[key] = (run, torch.from_numpy(run).to(self.device))
        run, on_device = self._runs[key]
        if not np.array_equal(rows, run):
            return torch.from_numpy(rows).to(self.device, non_blocking=True)
        return on_device

    def _ones(self, rows: int) -> torch.Tensor:
        """The row mask of a batch without padding, on the device (never written to)."""
        if rows not in self._masks:
            self._masks[rows] = torch.ones(rows, dtype=torch.float32, device=self.device)
        return self._masks[rows]

    # ----------------------------------------------------------------- placement

    def _free_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)


class _DeviceGathers(Placing[Gather]):
    """Rows translated into gathers of a step's rows from arrays copied to the device once
    (one copy of an array that several parts read)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._on_device: dict[int, torch.Tensor] = {}

    def array(self, rows: np.ndarray) -> Gather:
        return self._to_device(rows).__getitem__

    def mapped(self, rows: MappedRows) -> Gather:
        """Rows of a memory-mapped file, copied to the device in the file's dtype (uint8 images
        stay uint8 until here) and in this view's row order and shape; a step's rows are then
        one index away, cast there when the model takes another dtype."""
        array = self._to_device(rows.array)
        if rows.index is not None:
            array = array[torch.from_numpy(rows.index).to(self.device)]
        array = array.reshape(len(array), *rows.row_shape)
        dtype = getattr(torch, rows.dtype.name)
        if array.dtype == dtype:
            return array.__getitem__
        return lambda indices: array[indices].to(dtype)

    def windows(self, rows: TokenWindows) -> Gather:
        return _window_gather(rows, self._to_device(rows.tokens))

    def scaled(self, rows: ScaledRows) -> Gather:
        return _scaled_gather(translate(rows.raw, self), rows.scaling, self.device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        key = id(array)
        if key not in self._on_device:
            host = np.ascontiguousarray(torch_compatible(array))
            with warnings.catch_warnings():  # a read-only memory map: rows are only ever read
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                self._on_device[key] = torch.from_numpy(host).to(self.device)
        return self._on_device[key]


def as_torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a numpy one (as ``torch.from_numpy`` maps it)."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


def torch_compatible(array: np.ndarray) -> np.ndarray:
    """The array, or a widened copy when torch has no such dtype (uint16 tokens: int32)."""
    return array if array.dtype.type in _TORCH_DTYPES else array.astype(np.int32)


#: threads that gather one batch's rows into its staging buffer (numpy's take releases the
#: GIL, so chunks are read in parallel: docs/performance.md#measurements-behind-the-code)
GATHER_THREADS = 4
#: staging buffers per array: the one being filled, and the one whose copy may be in flight
STAGING_DEPTH = 2


class _Staging:
    """Reusable pinned host buffers for one array of the batch. A buffer is written again only
    after the device copy that read it has finished (its event)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self.turn = 0

    def next_buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        """A pinned buffer of the shape, free to overwrite (waits for its last copy)."""
        torch_dtype = as_torch_dtype(dtype)
        slot = self.turn % STAGING_DEPTH
        self.turn += 1
        if slot < len(self.buffers):
            buffer, copied = self.buffers[slot]
            if copied is not None:
                copied.synchronize()
            if tuple(buffer.shape) == shape and buffer.dtype == torch_dtype:
                return buffer
        buffer = torch.empty(shape, dtype=torch_dtype, pin_memory=True)
        if slot < len(self.buffers):
            self.buffers[slot] = (buffer, None)
        else:
            self.buffers.append((buffer, None))
        return buffer

    def mark_copied(self, buffer: torch.Tensor, copied: torch.cuda.Event) -> None:
        for slot, (held, _) in enumerate(self.buffers):
            if held is buffer:
                self.buffers[slot] = (held, copied)


class _DecodedBuffers:
    """Pinned buffers decoded images land in: one per batch in flight, however many the loop
    names ahead (each micro-batch of a step is one); a buffer is taken again only once the
    copy to the device that read it has finished."""

    def __init__(self) -> None:
        self._returned: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # taken on the loop's thread, given back on the copier's

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        with self._lock:
            found = next(
                (k for k, (buffer, _) in enumerate(self._returned) if tuple(buffer.shape) == shape), None
            )
            returned = None if found is None else self._returned.pop(found)
        if returned is None:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        buffer, copied = returned
        copied.synchronize()
        return buffer

    def give_back(self, buffer: torch.Tensor, copied: torch.cuda.Event) -> None:
        with self._lock:
            self._returned.append((buffer, copied))


@attrs.frozen(eq=False)
class _Decoding:
    """A batch's image rows decoding into a pinned buffer of exactly their shape."""

    buffer: torch.Tensor
    reading: ImageReading


class _Prefetcher:
    """Background threads that gather a batch's rows on the host straight into pinned staging
    buffers (no pageable copy, no pinning per step) and copy them to the GPU on a side
    stream. The step's stream waits for that copy's event, never for the host."""

    def __init__(self, device: torch.device, timeout_seconds: float) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crosstrain-prefetch")
        self.gatherers = ThreadPoolExecutor(
            max_workers=GATHER_THREADS, thread_name_prefix="crosstrain-gather"
        )
        self.staging: dict[str, _Staging] = {name: _Staging() for name in ("x", "y", "weight", "rows")}
        self.decoded = _DecodedBuffers()
        self.pending: Prefetched[tuple[tuple[torch.Tensor, ...], torch.cuda.Event]] = Prefetched(
            timeout_seconds
        )

    def submit(self, batch: Batch, convert_x: Convert | None) -> None:
        """Start reading the batch; ``convert_x`` turns its x rows as stored into the model's.
        Image files start decoding here, in the decoders' pool, so the batches the loop names
        ahead decode at once (the copying thread takes one batch at a time)."""
        decoding = self._start_decoding(batch)
        self.pending.put(batch, self.pool.submit(self._copy, batch, convert_x, decoding))

    def _start_decoding(self, batch: Batch) -> _Decoding | None:
        """The batch's image rows set decoding straight into a pinned buffer; None when its
        x rows are not image files."""
        source = batch.source
        images = None if source is None else image_rows(source.dataset.x)
        if images is None:
            return None
        assert source is not None
        buffer = self.decoded.take((len(source.indices), *images.shape[1:]))
        return _Decoding(buffer, images.start_read(source.indices, source.epoch, out=buffer.numpy()))

    def settle(self) -> None:
        self.pending.settle()

    def take(self, batch: Batch) -> tuple[torch.Tensor, ...] | None:
        found = self.pending.take(batch)
        if found is None:
            return None
        tensors, copied = found
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)
        for tensor in tensors:  # made on the side stream, used on this one
            tensor.record_stream(stream)
        return tensors

    def _copy(
        self, batch: Batch, convert_x: Convert | None, decoding: _Decoding | None
    ) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
        if decoding is not None:
            decoding.reading.result()
            x, x_shape = decoding.buffer, tuple(decoding.buffer.shape)
        else:
            x, x_shape = self._stage_rows("x", batch)
        y, y_shape = self._stage_rows("y", batch)
        staged = {"x": x, "y": y, "weight": self._stage("weight", batch.weight)}
        staged["rows"] = self._stage("rows", batch.rows)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            x, y, weight, rows = (staged[name].to(self.device, non_blocking=True) for name in staged)
            x, y = x.reshape(x_shape), y.reshape(y_shape)
            if convert_x is not None:  # x as stored: cast and scaled here, on the GPU
                x = convert_x(x)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self.stream)
        for name, buffer in staged.items():
            if name == "x" and decoding is not None:
                self.decoded.give_back(buffer, copied)
            else:
                self.staging[name].mark_copied(buffer, copied)
        return (x, y, weight, rows), copied

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        buffer = self.staging[name].next_buffer(array.shape, array.dtype)
        buffer.numpy()[...] = array
        return buffer

    def _stage_rows(self, name: str, batch: Batch) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The batch's rows of x or y in a pinned buffer as their data set stores them (image
        files: :meth:`_start_decoding`), and the shape they take. Rows of an array torch has
        the dtype of are gathered straight into the buffer by parallel chunks; token windows
        are read by numpy, then staged."""
        source = batch.source
        found = (
            None
            if source is None
            else stored_rows(getattr(source.dataset, name), source.indices, source.epoch)
        )
        if found is None:
            rows = getattr(batch, name)
            return self._stage(name, rows), rows.shape
        array, indices, shape = found
        if array.dtype.type not in _TORCH_DTYPES:  # widened on the host (uint16 images)
            return self._stage(name, torch_compatible(np.asarray(array[indices]))), shape
        buffer = self.staging[name].next_buffer((len(indices), *array.shape[1:]), array.dtype)
        gather_rows(self.gatherers, array, indices, buffer.numpy())
        return buffer, shape


def gather_rows(pool: ThreadPoolExecutor, array: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = array[indices]``, by the pool's threads in contiguous chunks of ``out``
    (numpy's take releases the GIL while it copies)."""
    chunks = np.array_split(np.arange(len(indices)), GATHER_THREADS)
    reads = [
        # mode "clip" writes straight into ``out`` ("raise" buffers a whole copy first); the
        # sampler's indices are in range
        pool.submit(np.take, array, indices[chunk], 0, out[chunk[0] : chunk[-1] + 1], "clip")
        for chunk in chunks
        if len(chunk)
    ]
    for read in reads:
        read.result()


_TORCH_OPERATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mul": torch.mul,
    "sub": torch.sub,
    "div": torch.div,
}


#: rows as stored, on the device -> the rows the model takes
Convert = Callable[[torch.Tensor], torch.Tensor]


def _converter(dtype: np.dtype[Any], scaling: InputScaling | None, device: torch.device) -> Convert:
    """A cast to ``dtype`` (none when the rows have it), or the scaling (its first step is
    the cast to float32): the same values as core's conversion on the host."""
    if scaling is not None:
        return scaler(scaling, device)
    torch_dtype = as_torch_dtype(dtype)
    return lambda rows: rows if rows.dtype == torch_dtype else rows.to(torch_dtype)


def scaler(scaling: InputScaling, device: torch.device) -> Convert:
    """Raw rows (uint8 images stay uint8 until here) scaled on the device by the same
    float32 operations, in the same order, as core's numpy reference."""
    steps = [
        (_TORCH_OPERATIONS[operation], torch.from_numpy(operand).to(device))
        for operation, operand in scaling.steps()
    ]

    def scale(raw: torch.Tensor) -> torch.Tensor:
        x = raw.to(torch.float32)
        for operation, operand in steps:
            x = operation(x, operand)
        return x

    return scale


def _scaled_gather(raw: Gather, scaling: InputScaling, device: torch.device) -> Gather:
    scale = scaler(scaling, device)  # the placed rows gathered, then scaled
    return lambda indices: scale(raw(indices))


def _window_gather(windows: TokenWindows, tokens: torch.Tensor) -> Gather:
    """Row i of the windows, read from the placed token array: tokens[(first+i)*L + offset + k]."""
    offsets = torch.arange(windows.length, device=tokens.device) + windows.offset
    dtype = getattr(torch, windows.dtype.name)

    def gather(indices: torch.Tensor) -> torch.Tensor:
        starts = (indices + windows.first) * windows.length
        return tokens[starts[:, None] + offsets[None, :]].to(dtype)

    return gather
