"""The pool of worker processes that decodes a training process's image rows
(:func:`crosstrain.core.data.sources.decoding.decode_rows`, a chunk at a time).

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
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.util import Finalize

import attrs
import numpy as np

from crosstrain.core.data.sources.decoding import FileRows, decode_rows
from crosstrain.core.errors import InputError

#: the variable that sets the workers per training process (the old name still works)
WORKERS_VARIABLES = ("CROSSTRAIN_DECODE_WORKERS", "CROSSTRAIN_DECODE_THREADS")
#: what a worker runs: its task and result pipes' descriptors follow on the command line
_WORKER_CODE = (
    "import sys; from crosstrain.core.data.sources.pool import serve; serve(*map(int, sys.argv[1:]))"
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


# --------------------------------------------------------------------------- the worker


@attrs.frozen
class Chunk:
    """One worker's contiguous rows of one batch: the one message a worker gets per batch."""

    job: int
    slot: int
    buffer: str  # the shared memory's name
    capacity: int  # its bytes
    first: int  # the chunk's first row in the batch
    rows: FileRows


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
        row_shape = (*chunk.rows.size, 3)
        rows = np.ndarray((chunk.capacity // int(np.prod(row_shape)), *row_shape), np.uint8, buffer)
        target = rows[chunk.first : chunk.first + len(chunk.rows.paths)]
        error = decode_rows(chunk.rows, target)
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
        files = self.sent[0].rows.paths if self.sent else []
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
        # multiprocessing's finaliser, not weakref's: it also runs as a process that
        # multiprocessing started (a torch worker forked by the elastic agent) ends, where
        # exit handlers do not run; left behind, the buffers are the resource tracker's to
        # free, and it warns of each on the launcher's stderr
        self._finalizer = Finalize(self, _stop, (self.workers, self._slots, self._closing), exitpriority=0)
        self._collector = threading.Thread(
            target=self._collect, name="crosstrain-decode-results", daemon=True
        )
        self._collector.start()

    def submit(self, rows: FileRows, out: np.ndarray) -> Reading:
        """Start decoding ``rows`` into ``out``, in contiguous chunks dealt to the workers
        as they free up; each chunk is copied into ``out`` as soon as its worker answers, so
        only the last chunk's copy is left when the batch is done."""
        paths = rows.paths
        shape = (len(paths), *rows.size, 3)
        if out.shape != shape or out.dtype != np.uint8:
            raise ValueError(f"decoded rows go into uint8 {shape}, not {out.dtype} {out.shape}")
        pieces = min(len(paths), len(self.workers) * CHUNKS_PER_WORKER)
        cuts = [cut for cut in np.array_split(np.arange(len(paths)), pieces) if len(cut)] if pieces else []
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
                number, slot.number, slot.memory.name, slot.memory.size, int(cut[0]),
                rows.part(int(cut[0]), int(cut[-1]) + 1),
            )
            for cut in cuts
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
            rows = slice(chunk.first, chunk.first + len(chunk.rows.paths))
            view = job.slot.rows(rows.stop, chunk.rows.size)
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
