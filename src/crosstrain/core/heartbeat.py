"""The per-step heartbeat every rank writes, so a launcher can tell which rank stopped.

A launcher that watches its workers sets :data:`HEARTBEAT_DIR` in their environment; the
loop then records, before and after every train step and every eval batch, how many beats
this rank has made, the last step it finished and what it is doing, in ``rank-N`` there.
Every rank runs the same sequence of steps and eval batches, so the beat counts of ranks
are comparable: when one rank hangs, its peers stop too (waiting in the next collective),
but one beat further on; the rank with the fewest beats is the one that is really behind.

One ``os.pwrite`` of a fixed-width record into an open file: a few microseconds a beat,
and nothing at all when the variable is unset. Framework-free, so core may call it.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

#: the folder a launcher watches (set by the launcher, read by every rank)
HEARTBEAT_DIR = "CROSSTRAIN_HEARTBEAT_DIR"
#: the collectives' own timeout exceeds the heartbeat deadline by this much, so that a hang is
#: diagnosed by the launcher (naming the rank that stopped) before a healthy peer's wait
#: times out (naming itself)
COLLECTIVE_MARGIN_SECONDS = 30.0
_RECORD_WIDTH = 64


def collective_timeout(timeout_seconds: float) -> float:
    """The timeout for a backend's collectives (gloo/NCCL, tf) under ``--timeout``."""
    return timeout_seconds + COLLECTIVE_MARGIN_SECONDS


def heartbeat_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}"


def _record(pid: int, count: int, step: int, phase: str) -> bytes:
    return f"{pid} {count} {step} {phase}".ljust(_RECORD_WIDTH - 1).encode("ascii") + b"\n"


@attrs.frozen
class Beat:
    """One record: the rank's process, its beat count, the last step it finished, and
    what it is doing now ("start", "step", "idle", "eval")."""

    pid: int
    count: int
    step: int
    phase: str

    def encode(self) -> bytes:
        return _record(self.pid, self.count, self.step, self.phase)

    @classmethod
    def decode(cls, data: bytes) -> Beat | None:
        """None for a record not (yet, or not completely) written."""
        parts = data.decode("ascii", errors="replace").split()
        if len(parts) != 4:
            return None
        try:
            return cls(pid=int(parts[0]), count=int(parts[1]), step=int(parts[2]), phase=parts[3])
        except ValueError:
            return None


class Heartbeat:
    """This rank's writer; every method is a no-op when no launcher is watching."""

    def __init__(self, rank: int, folder: str | None = None) -> None:
        folder = os.environ.get(HEARTBEAT_DIR) if folder is None else folder
        self._fd: int | None = None
        self._count, self._step, self._pid = 0, 0, os.getpid()
        if folder:
            try:
                self._fd = os.open(heartbeat_path(folder, rank), os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:  # the launcher's folder is gone: nobody is watching
                self._fd = None
        self.beat("start")

    def beat(self, phase: str, step: int | None = None) -> None:
        if self._fd is None:
            return
        if step is not None:
            self._step = step
        self._count += 1
        record = _record(self._pid, self._count, self._step, phase)  # no Beat: two a step
        try:
            os.pwrite(self._fd, record, 0)
        except OSError:
            self._fd = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_beat(path: Path) -> Beat | None:
    try:
        return Beat.decode(path.read_bytes()[:_RECORD_WIDTH])
    except OSError:
        return None
