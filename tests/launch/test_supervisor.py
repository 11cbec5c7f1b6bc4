"""The shared launcher with real child processes (no framework): how a failing worker is
found and reported, its peers stopped, and its temporary folders removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.errors import Interrupted, PlanError, WorkerError, WorkerStalled
from crosstrain.launch import WorkerSpec, error_summary, launch_folder, run_workers, stop_processes, supervise
from crosstrain.launch.outcomes import first_failure
from crosstrain.launch.supervisor import remove_orphaned_folders


def test_error_summary_keeps_the_cause_of_tensorflow_errors() -> None:
    tf_style = ValueError("in user code:\n\n    File x.py, line 3\n\n    ValueError: shapes differ\n")
    assert error_summary(tf_style) == "ValueError: shapes differ"
    assert error_summary(RuntimeError("boom\nmore")) == "RuntimeError: boom"
    assert error_summary(PlanError("bad", field="train.epochs")) == "train.epochs: bad"
    assert error_summary(KeyboardInterrupt()) == "KeyboardInterrupt"


def _error_file(run_dir: Path, rank: int, message: str, when: float, exit_code: int = 1) -> None:
    report = {"message": message, "traceback": f"Traceback of {rank}", "time": when, "exit_code": exit_code}
    (run_dir / f"error-{rank}.json").write_text(json.dumps(report))


def test_the_first_error_written_is_the_one_reported(tmp_path: Path) -> None:
    _error_file(tmp_path, 0, "UnavailableError: socket closed", when=20.0)
    _error_file(tmp_path, 1, "RuntimeError: the cause", when=10.0)
    error = first_failure([0, 1], {0: 1, 1: 1}, tmp_path)
    assert (error.rank, str(error), error.traceback_text, error.exit_code) == (
        1,
        "rank 1 failed: RuntimeError: the cause",
        "Traceback of 1",
        1,
    )
    # a rank killed outright is the cause; its peer's report only echoes the broken collective
    (tmp_path / "error-1.json").unlink()
    killed = first_failure([0, 1], {0: 1, 1: -9}, tmp_path)
    assert (killed.rank, str(killed)) == (1, "rank 1 failed: killed by signal SIGKILL")


def test_a_rank_that_aborted_itself_is_blamed_last(tmp_path: Path) -> None:
    """Seen in CI: rank 1 was killed and rank 0, its gloo peer, aborted in the same instant."""
    aborted, killed = -signal.SIGABRT, -signal.SIGKILL
    assert (
        str(first_failure([0, 1], {0: aborted, 1: killed}, tmp_path))
        == "rank 1 failed: killed by signal SIGKILL"
    )
    _error_file(tmp_path, 1, "RuntimeError: the cause", when=10.0)
    assert (
        str(first_failure([0, 1], {0: aborted, 1: 1}, tmp_path)) == "rank 1 failed: RuntimeError: the cause"
    )
    (tmp_path / "error-1.json").unlink()
    assert (
        str(first_failure([1], {0: None, 1: aborted}, tmp_path)) == "rank 1 failed: killed by signal SIGABRT"
    )


def test_bad_input_found_in_a_worker_keeps_exit_code_2(tmp_path: Path) -> None:
    _error_file(tmp_path, 0, "plan.toml: data.path: bad", when=1.0, exit_code=2)
    assert first_failure([0], {0: 1}, tmp_path).exit_code == 2


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _supervised_failure(folder: Path, *codes: str) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """The failure :func:`supervise` names for children running ``codes`` (rank k the k-th),
    and the children, stopped."""
    children = [_child(code) for code in codes]
    try:
        with pytest.raises(WorkerError) as raised:
            supervise(dict(enumerate(children)), folder)
    finally:
        stop_processes(children)
    return str(raised.value), children


def test_a_failing_worker_stops_the_others_at_once(tmp_path: Path) -> None:
    """A peer stuck forever (as in a collective whose partner died) is terminated."""
    _error_file(tmp_path, 1, "RuntimeError: injected", when=time.time())
    failure, (stuck, _) = _supervised_failure(
        tmp_path, "import time; time.sleep(600)", "import time, sys; time.sleep(0.5); sys.exit(1)"
    )
    assert failure.startswith("rank 1 failed: RuntimeError: injected")
    assert stuck.poll() is not None  # stopped, not left running


def test_an_abort_waits_for_the_peer_death_it_echoes(tmp_path: Path) -> None:
    """Seen in CI under load: rank 0 aborted (its gloo peer's socket closed) and exited
    before rank 1, SIGKILLed first, finished tearing down; rank 1 is the cause named."""
    failure, _ = _supervised_failure(
        tmp_path,
        "import os; os.abort()",
        "import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)",
    )
    assert failure == "rank 1 failed: killed by signal SIGKILL"


def test_stop_kills_a_worker_that_ignores_sigterm() -> None:
    stubborn = _child(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(600)"
    )
    time.sleep(0.5)  # let it install the handler
    stop_processes([stubborn])
    assert stubborn.returncode == -9


def test_a_worker_exiting_cleanly_without_a_result_is_a_failure(tmp_path: Path) -> None:
    quiet = _child("pass")
    with pytest.raises(WorkerError, match="rank 0 failed: exited without reporting a result"):
        supervise({0: quiet}, tmp_path)


_BEATING_WORKER = (
    "import os, time\n"
    "from crosstrain.core.run.heartbeat import Heartbeat\n"
    "beat = Heartbeat(int(os.environ['CROSSTRAIN_LAUNCH_RANK']))\n"
    "for step in range(1, 3):\n"
    "    beat.beat('step'); beat.beat('idle', step)\n"
    "time.sleep(600)\n"
)


def test_a_silent_worker_is_stopped_naming_its_last_step(tmp_path: Path) -> None:
    spec = WorkerSpec(3, [sys.executable, "-c", _BEATING_WORKER], dict(os.environ))
    started = time.monotonic()
    with pytest.raises(WorkerStalled, match=r"^rank 3 made no progress for 1 s after step 2 \(--timeout 1\)"):
        run_workers([spec], tmp_path, timeout_seconds=1.0)
    assert time.monotonic() - started < 15


_STARTED_WORKER = (
    "import os, pathlib, time\n"
    "pathlib.Path(os.environ['CROSSTRAIN_LAUNCH_DIR'], 'started').touch()\n"
    "time.sleep(600)\n"
)


def _signal_once_started(folder: Path, number: int) -> threading.Thread:
    def send() -> None:
        deadline = time.monotonic() + 60
        while not (folder / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), number)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigterm_stops_the_workers_and_raises_interrupted() -> None:
    """Even with restarts left: a signal to the launcher is the user's, never retried."""
    spec = WorkerSpec(0, [sys.executable, "-c", _STARTED_WORKER], dict(os.environ))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as raised, launch_folder("unit") as folder:
        _signal_once_started(folder, signal.SIGTERM)
        run_workers([spec], folder, timeout_seconds=60, max_restarts=2)
    assert raised.value.exit_code == 143 and str(raised.value) == "interrupted"
    assert not folder.exists()  # the temporary folder is removed on this exit too
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


def test_folders_of_launchers_that_were_killed_are_removed(tmp_path: Path) -> None:
    code = "import os; print(os.getpid())"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    orphan = tmp_path / f"crosstrain-tf-{dead.stdout.strip()}-abc"
    mine = tmp_path / f"crosstrain-tf-{os.getpid()}-abc"
    orphan.mkdir(), mine.mkdir()
    remove_orphaned_folders(tmp_path)
    assert not orphan.exists() and mine.exists()


# --------------------------------------------------------------------------- --max-restarts

#: rank 1 fails (as FAULT says) in the group's first start (in every start: "always"),
#: while rank 0 waits forever; in a restart both report the restart count they were given
_FAIL_ONCE_WORKER = """
import os, pathlib, signal, time
from crosstrain.core.run.heartbeat import Heartbeat
from crosstrain.launch import serve
from crosstrain.launch.worker import restart_count, worker_rank

def train():
    rank, restart = worker_rank(), restart_count()
    marker = pathlib.Path(os.environ["MARKER"])
    if restart == 0 and rank == 0:
        beat = Heartbeat(rank)  # ahead of rank 1: rank 1 is the one a stall is blamed on
        beat.beat("step"), beat.beat("idle", 8)
        time.sleep(600)  # stopped with the group when its peer fails
    if rank == 1 and (not marker.exists() or os.environ["FAULT"] == "always"):
        marker.touch()
        if os.environ["FAULT"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ["FAULT"] == "hang":
            Heartbeat(rank).beat("idle", 7)
            time.sleep(600)
        raise RuntimeError(f"rank {rank} failed in start {restart}")
    return {"rank": rank, "restart": restart, "pid": os.getpid()}

serve(train)
"""


def _fail_once_specs(tmp_path: Path, fault: str, made: list[int]) -> Callable[[int], list[WorkerSpec]]:
    def specs(restart: int) -> list[WorkerSpec]:
        made.append(restart)
        environment = dict(os.environ, MARKER=str(tmp_path / "failed"), FAULT=fault)
        return [WorkerSpec(rank, [sys.executable, "-c", _FAIL_ONCE_WORKER], environment) for rank in (0, 1)]

    return specs


@pytest.mark.parametrize("fault", ["raise", "kill", "hang"])
def test_a_failed_or_stalled_rank_restarts_the_whole_group(
    tmp_path: Path, fault: str, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[int] = []
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000040").mkdir(parents=True)
    (run / "checkpoints" / "step-00000040" / "state.json").write_text("{}")
    with launch_folder("unit") as folder:
        results = run_workers(
            _fail_once_specs(tmp_path, fault, made), folder, 1.0, max_restarts=1, run_folder=run
        )
        assert sorted(path.name for path in folder.glob("heartbeat-*")) == ["heartbeat-0", "heartbeat-1"]
    assert made == [0, 1]  # fresh specs (ports) for the restart
    assert [results[rank]["restart"] for rank in (0, 1)] == [1, 1]  # rank 0 was restarted too
    why = {
        "raise": "rank 1 failed: RuntimeError: rank 1 failed in start 0",
        "kill": "rank 1 failed: killed by signal SIGKILL",
        "hang": "rank 1 made no progress for 1 s after step 7 (--timeout 1); every worker was stopped",
    }[fault]
    assert capsys.readouterr().err == f"crosstrain: {why}; restarting the group (1 of 1) from step 40\n"
    # the restarted failure's traceback is kept in the run folder; a killed or silent rank has none
    log = run / "error.log"
    if fault == "raise":
        assert f"{why}\nTraceback (most recent call last):" in log.read_text()
        assert "RuntimeError: rank 1 failed in start 0" in log.read_text()
    else:
        assert not log.exists()


def test_the_last_failure_is_the_error_once_restarts_run_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[int] = []
    with pytest.raises(WorkerError) as raised, launch_folder("unit") as folder:
        run_workers(_fail_once_specs(tmp_path, "always", made), folder, 60.0, max_restarts=2)
    assert str(raised.value) == "rank 1 failed: RuntimeError: rank 1 failed in start 2"
    assert raised.value.exit_code == 1 and made == [0, 1, 2]
    assert capsys.readouterr().err.splitlines() == [
        f"crosstrain: rank 1 failed: RuntimeError: rank 1 failed in start {restart - 1}; "
        f"restarting the group ({restart} of 2) from the start"
        for restart in (1, 2)
    ]
    assert not folder.exists()


_BAD_INPUT_WORKER = """
from crosstrain.core.errors import PlanError
from crosstrain.launch import serve

def train():
    raise PlanError("no such file", field="data.path")

serve(train)
"""


def test_bad_input_found_in_a_worker_is_never_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[int] = []

    def specs(restart: int) -> list[WorkerSpec]:
        made.append(restart)
        return [WorkerSpec(0, [sys.executable, "-c", _BAD_INPUT_WORKER], dict(os.environ))]

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(WorkerError, match=r"rank 0 failed: data\.path: no such file") as raised:
        run_workers(specs, tmp_path, 60.0, max_restarts=3, run_folder=run)
    assert raised.value.exit_code == 2 and raised.value.bad_input and made == [0]
    assert capsys.readouterr().err == ""
    # the CLI prints the line alone and names the file that keeps the worker's traceback
    assert raised.value.log == run / "error.log"
    assert "crosstrain.core.errors.PlanError: data.path: no such file" in raised.value.log.read_text()
