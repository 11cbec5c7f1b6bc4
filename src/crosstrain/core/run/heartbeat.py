"""The per-step heartbeat every rank writes, so a launcher can tell which rank stopped.

A launcher that watches its workers sets :data:`HEARTBEAT_DIR` in their environment; the
loop then records, before and after every train step and every eval batch, how many beats
this rank has made, the last step it finished and what it is doing, in ``rank-N`` there.
Every rank runs the same sequence of steps and eval batches, so the beat counts of ranks
are comparable: when one rank hangs, its peers stop too (waiting in the next collective),
but one beat further on; the rank with the fewest beats is the one that is really behind.

A beat copies a fixed-width record into the file, mapped into memory: no system call, as
there are two beats a step (docs/performance.md#measurements-behind-the-code), and nothing
at all when the variable is unset. A reader may catch a record half copied: only the
changing fields (count, step, phase) can mix, never the pid, and the next poll reads it
whole.
Framework-free, so core may call it.
"""

from __future__ import annotations

import mmap
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
        self._record: mmap.mmap | None = None
        self._count, self._step, self._pid = 0, 0, os.getpid()
        if folder:
            self._record = _mapped_record(heartbeat_path(folder, rank))
        self.beat("start")

    def beat(self, phase: str, step: int | None = None) -> None:
        if self._record is None:
            return
        if step is not None:
            self._step = step
        self._count += 1
        self._record[:] = _record(self._pid, self._count, self._step, phase)  # no Beat: two a step

    def close(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record = None


def _mapped_record(path: Path) -> mmap.mmap | None:
    """The rank's record file, one record long, mapped shared (a write is the file's
    content for every reader); None when the launcher's folder is gone: nobody is watching."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        os.ftruncate(descriptor, _RECORD_WIDTH)
        return mmap.mmap(descriptor, _RECORD_WIDTH)  # the mapping keeps the file open
    except OSError:
        return None
    finally:
        os.close(descriptor)


def read_beat(path: Path) -> Beat | None:
    try:
        return Beat.decode(path.read_bytes()[:_RECORD_WIDTH])
    except OSError:
        return None
