"""Decoding image rows: :func:`decode_image` (one file to one uint8 row) and the pool of
worker processes that runs it for a training process.

Why processes: Pillow holds the GIL for much of a row's work (opening, ``draft``,
``convert``, the conversion to numpy, the augmentation's numpy steps), so a pool of threads
decodes at about one core's rate however many cores there are (docs/data.md has the
measurement). Each worker is a fresh interpreter (``sys.executable -c``, never a fork: the
parent may hold CUDA or TensorFlow state) that imports numpy, Pillow and crosstrain's core
only — not ``multiprocessing``'s spawn, which would import the parent's ``__main__`` module
(a backend's, with its framework) in every worker.

How a batch travels: the pool keeps a ring of shared-memory buffers (one per batch in
flight, grown when a batch is bigger). A batch's rows are cut into a few contiguous chunks per
worker (``CHUNKS_PER_WORKER``: a handful of messages a batch, not one a row), dealt to the
workers as they free up (each holds at most ``CHUNKS_AHEAD``), so a worker whose core is busy
with other work takes fewer and the batch does not wait on it. A chunk's message carries its
files, their draws, the buffer and its first row; the worker decodes straight into the buffer
and answers with one small message, and the parent copies that chunk into the caller's array
(a backend's pinned buffer) at once. No pixel is pickled.

Failures are one line: a file that does not decode is an :class:`InputError` naming it (the
worker goes on); a worker that dies fails every batch in flight with an InputError naming the
worker and the files it was decoding; a later read starts a fresh pool.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import os
import signal
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from crosstrain.core.augment import (
    Augmentation,
    centre_box,
    color_jitter,
    crop_boxes,
    flips,
    jitter_factors,
    pad_crop,
    pad_offsets,
)
from crosstrain.core.errors import InputError

if TYPE_CHECKING:
    from PIL import Image

IMAGES_EXTRA = "pip install 'crosstrain[images]'"
#: the variable that sets the workers per training process (the old name still works)
WORKERS_VARIABLES = ("CROSSTRAIN_DECODE_WORKERS", "CROSSTRAIN_DECODE_THREADS")
#: what a worker runs: its task and result pipes' descriptors follow on the command line
_WORKER_CODE = (
    "import sys; from crosstrain.core.sources.decoding import serve; serve(*map(int, sys.argv[1:]))"
)
#: a batch is cut into this many chunks per worker (a few messages, not one a row), and a
#: worker holds at most ``CHUNKS_AHEAD`` of them: chunks go to whichever workers free up
CHUNKS_PER_WORKER = 2
CHUNKS_AHEAD = 2
#: how long a stopping worker may take before it is killed
_STOP_SECONDS = 5.0
#: POSIX shared memory's folder on Linux (a worker maps a buffer from it untracked: the
#: parent owns and unlinks every buffer)
_SHM_FOLDER = "/dev/shm"


def pillow() -> Any:
    """Pillow's Image module, or one line naming the extra that brings it."""
    try:
        from PIL import Image
    except ImportError:
        raise InputError(f"data.source = 'images' needs Pillow: {IMAGES_EXTRA}") from None
    return Image


# --------------------------------------------------------------------------- one row


#: what Pillow raises for a file it cannot read as an image
UNDECODABLE = (OSError, ValueError, SyntaxError)
#: a decoded cache's pixels file (core/sources/cache.py writes it)
CACHE_PIXELS = "pixels.u8"
#: where rows lie in a decoded cache: its folder, and per row (first byte, height, width)
Cached = tuple[str, np.ndarray]


def opencv() -> Any:
    """OpenCV's module, set to one thread (each worker is one core's worth), or one line
    naming the extra that brings it."""
    try:
        import cv2
    except ImportError:
        raise InputError(f"data.antialias = false resizes with OpenCV: {IMAGES_EXTRA}") from None
    cv2.setNumThreads(1)
    return cv2


def decode_image(
    path: str,
    size: tuple[int, int],
    augmentation: Augmentation | None,
    draws: np.ndarray | None,
    antialias: bool = True,
) -> np.ndarray:
    """One file as uint8 ``(h, w, 3)``: boxed, resized, padded-cropped and flipped as
    ``augmentation`` and this row's ``draws`` say (None: the centre box only); resized by
    Pillow's antialiased bilinear filter, or without ``antialias`` by OpenCV's bit-exact
    bilinear interpolation."""
    row = np.empty((1, *size, 3), np.uint8)
    one_draw = None if draws is None else draws[None]
    failed = _decode_into([path], size, augmentation, one_draw, row, None, antialias)
    if failed is not None:
        raise failed[1]
    return np.asarray(row[0])


def decode_rows(
    paths: list[str],
    size: tuple[int, int],
    augmentation: Augmentation | None,
    draws: np.ndarray | None,
    out: np.ndarray,
    cached: Cached | None = None,
    antialias: bool = True,
) -> str | None:
    """``out[k]`` = row k of ``paths`` decoded (its pixels read from a decoded cache where
    ``cached`` says where they lie); the first file that does not decode stops the chunk and
    is named in the line returned (None when every row decoded)."""
    failed = _decode_into(paths, size, augmentation, draws, out, cached, antialias)
    return None if failed is None else f"cannot decode image {paths[failed[0]]}: {failed[1]}"


def _decode_into(
    paths: list[str],
    size: tuple[int, int],
    augmentation: Augmentation | None,
    draws: np.ndarray | None,
    out: np.ndarray,
    cached: Cached | None,
    antialias: bool,
) -> tuple[int, Exception] | None:
    """The rows decoded into ``out``, their draws turned into boxes, offsets and flips for
    all of them at once (numpy's cost is per call, not per row: a row at a time, the crop
    boxes alone took an eighth of a row's time); the first row that failed and its error."""
    if cached is not None:
        sizes = cached[1][:, 1:]
    else:
        sizes = np.zeros((len(paths), 2), np.int64)  # (height, width): the headers only
        jpeg = np.zeros(len(paths), bool)
        for k, path in enumerate(paths):
            try:
                with pillow().open(path) as opened:
                    sizes[k], jpeg[k] = opened.size[::-1], opened.format == "JPEG"
            except UNDECODABLE as error:
                return k, error
    augmented = augmentation if draws is not None else None
    boxes = _boxes(sizes, size, augmented, draws)
    for k, path in enumerate(paths):
        try:
            if cached is not None:
                _resize_cached(cached[0], cached[1][k], boxes[k], out[k], antialias)
            elif antialias:
                out[k] = _resized(path, boxes[k], size)
            else:
                _resize_exact(path, bool(jpeg[k]), sizes[k], boxes[k], out[k])
        except UNDECODABLE as error:
            return k, error
    if augmented is not None and draws is not None:
        _augment(out[: len(paths)], augmented, draws)
    return None


def _boxes(
    sizes: np.ndarray, size: tuple[int, int], augmentation: Augmentation | None, draws: np.ndarray | None
) -> np.ndarray:
    """int64 [rows, 4] (top, left, height, width): each row's random resized crop, or the
    evaluation's centre box."""
    if augmentation is not None and augmentation.crop_scale is not None and draws is not None:
        return crop_boxes(draws, sizes, augmentation.crop_scale)
    return np.array([centre_box(int(h), int(w), *size) for h, w in sizes], np.int64).reshape(-1, 4)


def _resized(path: str, box: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The file's ``box`` (top, left, height, width) resized to ``size``, uint8 HWC."""
    image = pillow()
    out_h, out_w = size
    top, left, box_h, box_w = (int(v) for v in box)
    with image.open(path) as opened:
        width, height = opened.size
        decoded = _draft(opened, (width, height), box_h, box_w, size)
        scale_x, scale_y = decoded.size[0] / width, decoded.size[1] / height
        resized = decoded.convert("RGB").resize(
            (out_w, out_h),
            image.Resampling.BILINEAR,
            box=(left * scale_x, top * scale_y, (left + box_w) * scale_x, (top + box_h) * scale_y),
        )
        return np.asarray(resized, np.uint8)


def _resize_exact(path: str, jpeg: bool, full: np.ndarray, box: np.ndarray, out: np.ndarray) -> None:
    """The file's ``box`` (top, left, height, width) resized into ``out`` by OpenCV: decoded
    by the libjpeg-turbo Pillow uses too (the same pixels), at the DCT scale Pillow's
    ``draft`` picks; the box, scaled with it, rounded to whole pixels."""
    cv2 = opencv()
    height, width = (int(v) for v in full)
    top, left, box_h, box_w = (int(v) for v in box)
    reduction = _dct_reduction(width, height, box_h, box_w, out.shape[:2]) if jpeg else 1
    encoded = np.fromfile(path, np.uint8)
    decoded = cv2.imdecode(encoded, _REDUCED_READS[reduction])
    if decoded is None:
        raise ValueError("OpenCV cannot decode it (damaged or cut short)")
    scale_y, scale_x = decoded.shape[0] / height, decoded.shape[1] / width
    rows = slice(round(top * scale_y), max(round(top * scale_y) + 1, round((top + box_h) * scale_y)))
    columns = slice(round(left * scale_x), max(round(left * scale_x) + 1, round((left + box_w) * scale_x)))
    _resize_into(cv2, decoded[rows, columns], out)


def _resize_into(cv2: Any, pixels: np.ndarray, out: np.ndarray) -> None:
    """``pixels`` (uint8 HWC) resized into ``out`` by OpenCV's bit-exact bilinear filter."""
    cv2.resize(pixels, (out.shape[1], out.shape[0]), dst=out, interpolation=cv2.INTER_LINEAR_EXACT)


def _dct_reduction(width: int, height: int, box_h: int, box_w: int, size: tuple[int, ...]) -> int:
    """The DCT scale (1, 2, 4, 8) Pillow's ``draft`` picks for the box's output pixels."""
    needed = (-(-width * size[1] // box_w), -(-height * size[0] // box_h))
    scale = min(width // needed[0], height // needed[1])
    return next((denominator for denominator in (8, 4, 2) if scale >= denominator), 1)


#: OpenCV's read flags per DCT reduction: RGB (not its usual BGR), three channels
_REDUCED_READS = {1: 256, 2: 256 | 16, 4: 256 | 32, 8: 256 | 64}  # IMREAD_COLOR_RGB | IMREAD_REDUCED_*


#: each process's maps of the caches it read (folder -> the pixels file, read-only)
_CACHE_MAPS: dict[str, np.ndarray] = {}


def _cached_pixels(folder: str, entry: np.ndarray) -> np.ndarray:
    """A cached image's pixels (first byte, height, width: ``entry``), uint8 HWC over the
    cache's memory map (no copy)."""
    pixels = _CACHE_MAPS.get(folder)
    if pixels is None:
        pixels = _CACHE_MAPS[folder] = np.memmap(os.path.join(folder, CACHE_PIXELS), np.uint8, mode="r")
    start, height, width = (int(v) for v in entry)
    return pixels[start : start + height * width * 3].reshape(height, width, 3)


def _resize_cached(folder: str, entry: np.ndarray, box: np.ndarray, out: np.ndarray, antialias: bool) -> None:
    """A cached image's ``box`` (top, left, height, width) resized into ``out``."""
    pixels = _cached_pixels(folder, entry)
    top, left, box_h, box_w = (int(v) for v in box)
    if not antialias:
        _resize_into(opencv(), pixels[top : top + box_h, left : left + box_w], out)
        return
    image = pillow()
    decoded = image.frombuffer("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGB", 0, 1)
    box_edges = (left, top, left + box_w, top + box_h)
    resized = decoded.resize((out.shape[1], out.shape[0]), image.Resampling.BILINEAR, box=box_edges)
    out[...] = np.asarray(resized, np.uint8)


def _augment(rows: np.ndarray, augmentation: Augmentation, draws: np.ndarray) -> None:
    """The host's steps after the resize, in place, in their order: the padded crop, the
    flip, the colour jitter."""
    if augmentation.pad_crop:
        offsets = pad_offsets(draws, augmentation.pad_crop)
        for k in range(len(rows)):
            rows[k] = pad_crop(rows[k], augmentation.pad_crop, offsets[k])
    if augmentation.flip:
        mirrored = flips(draws)
        rows[mirrored] = rows[mirrored, :, ::-1]
    if augmentation.color_jitter is not None and any(augmentation.color_jitter):
        factors = jitter_factors(draws, augmentation.color_jitter)
        for k in range(len(rows)):
            rows[k] = color_jitter(rows[k], factors[k])


def _draft(
    opened: Image.Image, full: tuple[int, int], box_h: int, box_w: int, size: tuple[int, int]
) -> Image.Image:
    """A JPEG set to decode at the smallest of its DCT scales (1/1, 1/2, 1/4, 1/8) at which
    the box still has the output's pixels; other formats as they are."""
    if opened.format == "JPEG":
        width, height = full
        needed = (-(-width * size[1] // box_w), -(-height * size[0] // box_h))
        opened.draft("RGB", needed)
    return opened


# --------------------------------------------------------------------------- the worker


@attrs.frozen
class Chunk:
    """One worker's contiguous rows of one batch: the one message a worker gets per batch."""

    job: int
    slot: int
    buffer: str  # the shared memory's name
    capacity: int  # its bytes
    first: int  # the chunk's first row in the batch
    paths: list[str]
    size: tuple[int, int]
    augmentation: Augmentation | None
    draws: np.ndarray | None
    cached: Cached | None = None
    antialias: bool = True


def serve(task_fd: int, result_fd: int) -> None:
    """A worker's loop: decode each chunk into its buffer and answer ``(job, error)``, until
    the parent closes the task pipe (or goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    tasks, results = Connection(task_fd, writable=False), Connection(result_fd, readable=False)
    mapped: dict[int, tuple[str, mmap.mmap]] = {}
    while True:
        try:
            chunk: Chunk = tasks.recv()
        except EOFError:
            return
        buffer = _map(mapped, chunk)
        row_shape = (*chunk.size, 3)
        rows = np.ndarray((chunk.capacity // int(np.prod(row_shape)), *row_shape), np.uint8, buffer)
        target = rows[chunk.first : chunk.first + len(chunk.paths)]
        error = decode_rows(
            chunk.paths, chunk.size, chunk.augmentation, chunk.draws, target, chunk.cached, chunk.antialias
        )
        del rows, target
        results.send((chunk.job, error))


def _map(mapped: dict[int, tuple[str, mmap.mmap]], chunk: Chunk) -> mmap.mmap:
    """The chunk's buffer, mapped once per ring slot (again when the slot was regrown)."""
    known = mapped.get(chunk.slot)
    if known is not None and known[0] == chunk.buffer:
        return known[1]
    if known is not None:
        known[1].close()
    with open(os.path.join(_SHM_FOLDER, chunk.buffer), "r+b") as handle:
        buffer = mmap.mmap(handle.fileno(), chunk.capacity)
    mapped[chunk.slot] = (chunk.buffer, buffer)
    return buffer


# --------------------------------------------------------------------------- the pool


@attrs.define(eq=False)
class _Worker:
    number: int
    process: subprocess.Popen[bytes]
    tasks: Connection
    results: Connection
    #: each chunk sent and not yet answered, oldest first
    sent: collections.deque[Chunk] = attrs.field(factory=collections.deque)

    @classmethod
    def start(cls, number: int) -> _Worker:
        task_read, task_write = os.pipe()
        result_read, result_write = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, str(task_read), str(result_write)],
            pass_fds=(task_read, result_write),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(task_read)
        os.close(result_write)
        return cls(
            number, process, Connection(task_write, readable=False), Connection(result_read, writable=False)
        )

    def describe_death(self) -> str:
        code = self.process.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        files = self.sent[0].paths if self.sent else []
        doing = f" while decoding {len(files)} files, the first {files[0]}" if files else ""
        return f"image decoding worker {self.number} (pid {self.process.pid}) died ({how}){doing}"


@attrs.define(eq=False)
class _Slot:
    """One ring buffer: a batch's rows in shared memory."""

    number: int
    memory: SharedMemory

    def rows(self, count: int, size: tuple[int, int]) -> np.ndarray:
        return np.ndarray((count, *size, 3), np.uint8, self.memory.buf)


@attrs.define(eq=False)
class _Job:
    slot: _Slot
    out: np.ndarray  # where the rows go, chunk by chunk as each is answered
    waiting: int  # chunks not yet answered
    future: Future[None] = attrs.field(factory=Future)
    error: str | None = None


class DecodePool:
    """Worker processes decoding batches into a ring of shared-memory buffers."""

    def __init__(self, workers: int) -> None:
        self.workers = [_Worker.start(number) for number in range(workers)]
        #: why the pool stopped (a worker died); ``reported`` once a read has raised it
        self.broken: str | None = None
        self.reported = False
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._jobs: dict[int, _Job] = {}
        self._job_numbers = itertools.count()
        self._state = threading.Lock()  # jobs and slots; never held while a pipe is used
        self._sending = threading.Lock()  # the chunks waiting, and the task pipes
        self._waiting: collections.deque[Chunk] = collections.deque()
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(self, _stop, self.workers, self._slots, self._closing)
        self._collector = threading.Thread(
            target=self._collect, name="crosstrain-decode-results", daemon=True
        )
        self._collector.start()

    def submit(
        self,
        paths: list[str],
        size: tuple[int, int],
        augmentation: Augmentation | None,
        draws: np.ndarray | None,
        out: np.ndarray,
        cached: Cached | None = None,
        antialias: bool = True,
    ) -> Reading:
        """Start decoding ``paths`` into ``out``, in contiguous chunks dealt to the workers
        as they free up; each chunk is copied into ``out`` as soon as its worker answers, so
        only the last chunk's copy is left when the batch is done."""
        shape = (len(paths), *size, 3)
        if out.shape != shape or out.dtype != np.uint8:
            raise ValueError(f"decoded rows go into uint8 {shape}, not {out.dtype} {out.shape}")
        pieces = min(len(paths), len(self.workers) * CHUNKS_PER_WORKER)
        cuts = [rows for rows in np.array_split(np.arange(len(paths)), pieces) if len(rows)] if pieces else []
        with self._state:
            if self.broken is not None:
                self.reported = True
                raise InputError(self.broken)
            slot = self._take_slot(out.nbytes)
            number = next(self._job_numbers)
            job = _Job(slot, out, len(cuts))
            if cuts:
                self._jobs[number] = job
            else:  # no rows: nothing to wait for
                self._free.append(slot)
                job.future.set_result(None)
        chunks = [
            Chunk(
                number, slot.number, slot.memory.name, slot.memory.size, int(rows[0]),
                paths[rows[0] : rows[-1] + 1], size, augmentation,
                None if draws is None else draws[rows[0] : rows[-1] + 1],
                None if cached is None else (cached[0], cached[1][rows[0] : rows[-1] + 1]),
                antialias,
            )
            for rows in cuts
        ]  # fmt: skip
        with self._sending:
            self._waiting.extend(chunks)
        self._deal()
        return Reading(job)

    def _deal(self) -> None:
        """Send waiting chunks, in turn, to each worker with fewer than ``CHUNKS_AHEAD``
        chunks in hand: a worker that is slow (its core busy with other work) takes fewer,
        so a batch does not wait on it."""
        with self._sending:
            while self._waiting:
                ready = [worker for worker in self.workers if len(worker.sent) < CHUNKS_AHEAD]
                if not ready:
                    return
                for worker in ready:
                    if not self._waiting:
                        return
                    chunk = self._waiting.popleft()
                    worker.sent.append(chunk)
                    try:
                        worker.tasks.send(chunk)
                    except OSError:  # the worker is gone: the collector fails the pool
                        return

    def close(self) -> None:
        self._finalizer()

    def _take_slot(self, size: int) -> _Slot:
        """A free ring buffer of at least ``size`` bytes (a new one when all are in flight)."""
        slot = self._free.pop() if self._free else None
        if slot is not None and slot.memory.size >= size:
            return slot
        if slot is None:
            slot = _Slot(len(self._slots), _shared_memory(size))
            self._slots.append(slot)
            return slot
        slot.memory.close()
        slot.memory.unlink()
        slot.memory = _shared_memory(size)
        return slot

    def _collect(self) -> None:
        """Answers from the workers, until the pool closes; a worker's end fails the pool."""
        by_pipe = {worker.results: worker for worker in self.workers}
        try:
            while not self._closing.is_set():
                for ready in wait(list(by_pipe)):
                    worker = by_pipe[ready]  # type: ignore[index]
                    try:
                        number, error = worker.results.recv()
                    except (EOFError, OSError):
                        if not self._closing.is_set():
                            self._fail(worker.describe_death())
                        return
                    chunk = worker.sent.popleft()
                    if number != chunk.job:  # a worker answers its chunks in order
                        raise RuntimeError(f"worker {worker.number} answered batch {number}, not {chunk.job}")
                    self._answered(chunk, error)
                    self._deal()
        except Exception as error:  # never leave a reader waiting
            self._fail(f"image decoding failed: {error}")
        finally:
            for pipe in by_pipe:
                pipe.close()

    def _answered(self, chunk: Chunk, error: str | None) -> None:
        """A chunk is done: its rows copied out (the GIL released meanwhile); the last one
        frees the buffer and ends the batch."""
        with self._state:
            job = self._jobs[chunk.job]
        if error is None:
            rows = slice(chunk.first, chunk.first + len(chunk.paths))
            view = job.slot.rows(rows.stop, chunk.size)
            np.copyto(job.out[rows], view[rows])
            del view  # held only here: the buffer can be regrown or closed once freed
        with self._state:
            job.waiting -= 1
            job.error = job.error or error
            if job.waiting:
                return
            del self._jobs[chunk.job]
            self._free.append(job.slot)
        if job.error is not None:
            job.future.set_exception(InputError(job.error))
        else:
            job.future.set_result(None)

    def _fail(self, message: str) -> None:
        """A worker died: every batch in flight fails with ``message``; the workers stop."""
        with self._state:
            self.broken = message
            failed, self._jobs = list(self._jobs.values()), {}
            self.reported = bool(failed)
        with self._sending:
            self._waiting.clear()
        for worker in self.workers:  # their rows would be thrown away: no waiting for them
            worker.process.kill()
        self.close()
        for job in failed:
            job.future.set_exception(InputError(message))


@attrs.define(eq=False)
class Reading:
    """A batch being decoded into its ``out``."""

    job: _Job

    def result(self) -> np.ndarray:
        """The rows, once every chunk is in (an InputError naming the file, or the worker)."""
        self.job.future.result()
        return self.job.out

    def discard(self) -> None:
        """Wait for the batch, its rows unread (errors dropped too)."""
        self.job.future.exception()


def _shared_memory(size: int) -> SharedMemory:
    """A new ring buffer. Its pages are taken only as the workers write them, so a
    ``/dev/shm`` too small for it would kill a worker (SIGBUS) mid-batch: checked first."""
    if os.path.isdir(_SHM_FOLDER):
        stats = os.statvfs(_SHM_FOLDER)
        if stats.f_bavail * stats.f_frsize < size:
            raise InputError(
                f"{_SHM_FOLDER} has {stats.f_bavail * stats.f_frsize} bytes free; image decoding needs "
                f"{size} for a batch (a container's shared memory: docker run --shm-size=2g)"
            )
    try:
        return SharedMemory(create=True, size=max(size, 1))
    except OSError as error:
        raise InputError(
            f"cannot make a {size}-byte shared-memory buffer for image decoding: {error}"
        ) from None


def _stop(workers: list[_Worker], slots: list[_Slot], closing: threading.Event) -> None:
    """Close the task pipes (each worker ends at EOF), wait, kill a straggler, free the ring."""
    closing.set()
    for worker in workers:
        worker.tasks.close()
    for worker in workers:
        try:
            worker.process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
    for slot in slots:
        with contextlib.suppress(BufferError):  # a copy out was cut short: the unlink frees it
            slot.memory.close()
        slot.memory.unlink()
