"""Worker processes that cannot outlive their launcher, and signals turned into errors.

Every worker starts in its own process group (a terminal's Ctrl-C reaches the launcher
only, which then stops the workers in order) with a parent-death signal: when the
launcher dies, even by SIGKILL, Linux sends SIGKILL to each worker, so no worker trains on
and writes a summary for a run that was cancelled.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import NoReturn

from crosstrain.core.errors import Interrupted

STOP_SECONDS = 5.0  # after SIGTERM, how long a worker may take before SIGKILL
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once its exit handlers have run and its output is
    flushed, skipping the interpreter's teardown of its modules: with torch or TensorFlow
    imported that teardown takes over a second after every run
    (docs/performance.md#measurements-behind-the-code), and nothing crosstrain or a plugin
    writes needs it (files are closed and flushed, ``atexit`` handlers run here)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a pipe whose reader left
            stream.flush()
    os._exit(code)


def start_process(command: Sequence[str], environment: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """A worker in a new session (its own process group), killed if this process dies."""
    launcher = os.getpid()
    return subprocess.Popen(
        list(command),
        env=dict(environment),
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
