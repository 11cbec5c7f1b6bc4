"""The heartbeat every rank writes: one fixed-width record, rewritten in place, and
nothing at all without a launcher watching."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crosstrain.core.run.heartbeat import HEARTBEAT_DIR, Beat, Heartbeat, heartbeat_path, read_beat


def test_a_beat_is_one_record_with_the_count_and_the_last_finished_step(tmp_path: Path) -> None:
    beat = Heartbeat(2, str(tmp_path))
    for step in range(1, 13):
        beat.beat("step")
        beat.beat("idle", step)
    beat.beat("eval")
    assert len(heartbeat_path(tmp_path, 2).read_bytes()) == 64  # rewritten in place, never appended
    assert read_beat(heartbeat_path(tmp_path, 2)) == Beat(pid=os.getpid(), count=26, step=12, phase="eval")
    assert Beat.decode(b"") is None and Beat.decode(b"12 x") is None  # half-written: ignored


def test_without_a_launcher_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEARTBEAT_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    Heartbeat(0).beat("step")
    assert list(tmp_path.iterdir()) == []
