"""The heartbeat monitor names the rank that is behind, not the peer waiting for it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crosstrain.core.run.heartbeat import Beat, Heartbeat, heartbeat_path
from crosstrain.launch.monitor import STARTUP_SECONDS, StallMonitor, a_peer_has_exited


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(beat: Heartbeat, steps: int) -> None:
    for step in range(1, steps + 1):
        beat.beat("step")
        beat.beat("idle", step)


def test_the_rank_behind_is_blamed_not_the_peer_waiting_in_a_collective(tmp_path: Path) -> None:
    clock = Clock()
    monitor = StallMonitor(tmp_path, [0, 1], timeout_seconds=20, clock=clock)
    healthy, hung = Heartbeat(0, str(tmp_path)), Heartbeat(1, str(tmp_path))
    _steps(healthy, 5), _steps(hung, 5)
    assert monitor.check() is None
    clock.now = 1.0
    healthy.beat("step")  # rank 0 enters step 6 and waits there for rank 1
    assert monitor.check() is None
    clock.now = 20.5  # rank 0 silent 19.5 s, rank 1 silent 20.5 s
    stall = monitor.check()
    assert stall is not None and (stall.rank, stall.step) == (1, 5)
    assert str(stall).startswith("rank 1 made no progress for 20 s after step 5 (--timeout 20)")
    assert monitor.pids() == {0: os.getpid(), 1: os.getpid()}  # both beat from this test


def test_a_rank_still_starting_has_the_start_up_deadline(tmp_path: Path) -> None:
    clock = Clock()
    monitor = StallMonitor(tmp_path, [0, 1], timeout_seconds=5, clock=clock)
    Heartbeat(0, str(tmp_path))  # rank 0 has started and waits for rank 1, still importing
    clock.now = STARTUP_SECONDS - 1
    assert monitor.check() is None
    clock.now = STARTUP_SECONDS + 1
    stall = monitor.check()
    assert stall is not None and stall.rank == 1
    assert "after starting" in str(stall)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read from /proc")
def test_a_peer_that_exited_is_seen_while_it_waits_to_be_reaped(tmp_path: Path) -> None:
    """A torch worker that fails right after a peer exited waits, so that the agent names
    the peer: an exited worker is a zombie until the agent reaps it."""
    Heartbeat(0, str(tmp_path)).beat("step")  # this process
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        heartbeat_path(tmp_path, 1).write_bytes(Beat(peer.pid, 1, 0, "step").encode())
        assert not a_peer_has_exited(tmp_path)
        peer.kill()
        deadline = time.monotonic() + 10
        while not a_peer_has_exited(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.returncode is None and a_peer_has_exited(tmp_path)  # not reaped yet
    finally:
        peer.kill()
        peer.wait()
