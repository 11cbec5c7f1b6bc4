"""How the torch launcher names the failure that caused the others, from the elastic agent's
record of each failed process (the shared launcher's order, tests/launch/test_supervisor.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from crosstrain.backends.torch.launch import _worker_error

pytestmark = pytest.mark.torch


def _recorded(tmp_path: Path, local_rank: int, message: str, when: int) -> ProcessFailure:
    """A failure with the error file that ``@record`` writes for a Python exception, where
    the agent keeps it, written at ``when``."""
    path = tmp_path / "attempt_0" / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True)
    extra = {"py_callstack": f"Traceback of {local_rank}", "timestamp": str(when)}
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    os.utime(path, (when, when))
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


def test_the_earliest_report_is_blamed_when_the_agent_listed_only_its_echo(tmp_path: Path) -> None:
    """The agent lists the first failed worker its poll finds; the other workers' reports of
    the attempt are read too."""
    _recorded(tmp_path, 1, "RuntimeError: the cause", when=10)
    failures = {2: _recorded(tmp_path, 0, "RuntimeError: Connection closed by peer", when=11)}
    error = _worker_error(ChildFailedError("worker", failures))
    assert str(error) == "rank 3 failed: RuntimeError: the cause"  # this machine's ranks: 2, 3


@pytest.mark.parametrize(
    ("message", "line", "exit_code"),
    [
        ("InputError: cannot decode image a/1.jpg: truncated", "cannot decode image a/1.jpg: truncated", 2),
        ("CheckpointError: step-5 is damaged", "step-5 is damaged", 2),  # as the shared launcher
        ("RuntimeError: the cause", "RuntimeError: the cause", 1),
    ],
)
def test_bad_input_a_worker_found_is_its_line_and_exit_code_2(
    tmp_path: Path, message: str, line: str, exit_code: int
) -> None:
    """An error of exit code 2 raised in a worker (torch's error file names it by its type)
    is the CLI's one line and exit code 2; a crash keeps its kind and exit code 1."""
    error = _worker_error(ChildFailedError("worker", {1: _recorded(tmp_path, 1, message, when=10)}))
    assert (str(error), error.exit_code, error.bad_input) == (
        f"rank 1 failed: {line}",
        exit_code,
        exit_code == 2,
    )
