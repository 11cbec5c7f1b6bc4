"""How the torch launcher names the failure that caused the others, from the elastic agent's
record of each failed process (the shared launcher's order, tests/launch/test_supervisor.py)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from crosstrain.backends.torch.launch import _worker_error

pytestmark = pytest.mark.torch


def _recorded(tmp_path: Path, local_rank: int, message: str, when: int) -> ProcessFailure:
    """A failure with the error file that ``@record`` writes for a Python exception."""
    path = tmp_path / f"error-{local_rank}.json"
    extra = {"py_callstack": f"Traceback of {local_rank}", "timestamp": str(when)}
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=1, error_file=str(path))


def _signalled(local_rank: int, number: signal.Signals) -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=-number, error_file="")


def test_a_killed_rank_is_blamed_before_a_peer_that_aborted_in_the_same_instant() -> None:
    failures = {0: _signalled(0, signal.SIGABRT), 1: _signalled(1, signal.SIGKILL)}
    error = _worker_error(ChildFailedError("worker", failures))
    assert str(error) == "rank 1 failed: killed by signal SIGKILL"


def test_a_report_is_blamed_before_an_abort(tmp_path: Path) -> None:
    failures = {
        0: _signalled(0, signal.SIGABRT),
        1: _recorded(tmp_path, 1, "RuntimeError: the cause", when=10),
    }
    error = _worker_error(ChildFailedError("worker", failures))
    assert (str(error), error.traceback_text) == ("rank 1 failed: RuntimeError: the cause", "Traceback of 1")


def test_the_earliest_report_is_blamed(tmp_path: Path) -> None:
    failures = {
        0: _recorded(tmp_path, 0, "RuntimeError: Connection closed by peer", when=20),
        1: _recorded(tmp_path, 1, "RuntimeError: the cause", when=10),
    }
    assert (
        str(_worker_error(ChildFailedError("worker", failures))) == "rank 1 failed: RuntimeError: the cause"
    )
