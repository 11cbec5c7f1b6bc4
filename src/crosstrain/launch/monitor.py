"""Watch every rank's heartbeat and name the rank that stopped making progress.

A rank that hangs stops its peers too: they wait for it in the next collective. So the
monitor watches not the first rank it sees silent but the one that is behind: the fewest
beats (every rank makes the same beats in the same order, see
:mod:`crosstrain.core.run.heartbeat`), then the longest silent; the job has stalled when that
rank has been silent for the timeout. Times are this process's own
clock, taken when a rank's record changes, so no two clocks are ever compared.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

from crosstrain.core.errors import WorkerStalled
from crosstrain.core.run.heartbeat import Beat, heartbeat_path, read_beat

#: until a rank's first beat (interpreter and framework start-up, data loading), the
#: deadline is at least this long: a short --timeout is for steps, not for imports
STARTUP_SECONDS = 60.0


@attrs.define
class _RankState:
    beat: Beat | None
    changed_at: float


class StallMonitor:
    """Call :meth:`check` now and then; it returns the stall to report, or None."""

    def __init__(
        self,
        folder: Path,
        ranks: Iterable[int],
        timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder, self.timeout_seconds, self.clock = folder, timeout_seconds, clock
        started = clock()
        self.states = {rank: _RankState(None, started) for rank in ranks}

    def check(self) -> WorkerStalled | None:
        now = self.clock()
        for rank, state in self.states.items():
            beat = read_beat(heartbeat_path(self.folder, rank))
            if beat is not None and beat != state.beat:
                state.beat, state.changed_at = beat, now
        # the rank behind is the one to wait for: a peer blocked on a rank still starting up
        # (or computing slowly but beating) is not a stall
        rank = min(self.states, key=self._behind_key)
        state = self.states[rank]
        if not self._silent_too_long(state, now):
            return None
        step = state.beat.step if state.beat is not None else None
        return WorkerStalled(rank, now - state.changed_at, step, self.timeout_seconds)

    def pids(self) -> dict[int, int]:
        """The process of each rank that has beaten (a launcher that did not start the
        workers itself, torch's elastic agent, stops them by these)."""
        return {rank: state.beat.pid for rank, state in self.states.items() if state.beat is not None}

    def _silent_too_long(self, state: _RankState, now: float) -> bool:
        deadline = (
            self.timeout_seconds if state.beat is not None else max(self.timeout_seconds, STARTUP_SECONDS)
        )
        return now - state.changed_at > deadline

    def _behind_key(self, rank: int) -> tuple[int, float, int]:
        state = self.states[rank]
        count = state.beat.count if state.beat is not None else 0
        return (count, state.changed_at, rank)


def a_peer_has_exited(folder: Path) -> bool:
    """Whether a rank that beat in ``folder`` has exited (this process aside): a failure
    now is likely the echo of that peer's (its collective broke). A worker that exited
    stays a zombie until its launcher reaps it. Only Linux says (``/proc``)."""
    if not sys.platform.startswith("linux"):
        return False
    pids = {beat.pid for path in folder.glob("rank-*") if (beat := read_beat(path)) is not None}
    return any(not _running(pid) for pid in pids - {os.getpid()})


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # zombie, dead
