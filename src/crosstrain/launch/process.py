"""Worker processes that cannot outlive their launcher, and signals turned into errors.

Every worker starts in its own process group (a terminal's Ctrl-C reaches the launcher
only, which then stops the workers in order) with a parent-death signal: when the
launcher dies, even by SIGKILL, Linux sends SIGKILL to each worker, so no worker trains on
and writes a summary for a run that was cancelled.

Every worker also starts with glibc's malloc tuned for training (:func:`worker_environment`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType

from crosstrain.core.errors import Interrupted

STOP_SECONDS = 5.0  # after SIGTERM, how long a worker may take before SIGKILL
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

#: glibc's malloc in a worker: blocks up to 32 MiB (its own dynamic ceiling) come from the
#: heap, and freed memory is never handed back to the system while the worker trains. By
#: default glibc maps large blocks afresh and trims the heap's top whenever a step frees a
#: few MiB there, so every step faults in its activations' pages again: a CNN on this CPU
#: took ~1,500 page faults a step, 30 % of its time (measured; the same reason PyTorch's
#: CPU tuning guide preloads jemalloc, told never to decay). A step's peak recurs every step,
#: so the resident memory stays that peak. Elsewhere than glibc the variable means nothing.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1099511627776"
#: the user's own malloc settings, which are left as they are
MALLOC_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def worker_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` with :data:`MALLOC_TUNABLES`, unless it sets malloc up itself (its own
    tunables, or another allocator preloaded)."""
    if any(name in environment for name in MALLOC_SETTINGS):
        return dict(environment)
    return {**environment, "GLIBC_TUNABLES": MALLOC_TUNABLES}


@contextlib.contextmanager
def tuned_children() -> Iterator[None]:
    """Processes started in the block (a launcher that spawns from ``os.environ``) get
    :func:`worker_environment`; ``os.environ`` is as it was afterwards."""
    added = {name: value for name, value in worker_environment(os.environ).items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def die_with_parent(parent_pid: int, signal_number: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``signal_number`` to this process when its parent dies; exit now if
    the parent is already gone (it may have died before this call). Elsewhere a no-op: the
    launcher still stops its workers on every exit it can see."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal_number), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def start_process(command: Sequence[str], environment: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """A worker in a new session (its own process group), killed if this process dies."""
    launcher = os.getpid()
    return subprocess.Popen(
        list(command),
        env=worker_environment(environment),
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(launcher),
    )


def stop_processes(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process group still running, then SIGKILL what outlives STOP_SECONDS."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(timeout=STOP_SECONDS)
    for process in processes:  # whatever a worker started itself goes with it
        _signal_group(process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[bytes], signal_number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal_number)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`Interrupted` (so ``finally`` blocks
    stop the workers and remove temporary folders); the previous handlers come back after.
    Outside the main thread, Python allows no handlers: the block runs unchanged."""
    if not _in_main_thread():
        yield
        return
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    received: list[int] = []

    def raise_interrupted(signal_number: int, frame: FrameType | None) -> None:
        if not received:  # a second signal must not cut short the stopping of the workers
            received.append(signal_number)
            raise Interrupted(signal_number)

    for number in previous:
        signal.signal(number, raise_interrupted)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
