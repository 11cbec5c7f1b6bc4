"""What a worker leaves for its launcher: a result file, or an error file with one line, the
traceback, the time and the exit code the CLI should use. Written atomically (rename)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crosstrain.core.errors import ERROR_LOG, CrosstrainError, WorkerError


def result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"result-{rank}.json"


def error_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-{rank}.json"


def write_atomically(path: Path, data: Any) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data), encoding="utf-8")
    os.replace(temporary, path)


def read_result(run_dir: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads(result_path(run_dir, rank).read_text(encoding="utf-8")))


def read_error(run_dir: Path, rank: int) -> dict[str, Any] | None:
    path = error_path(run_dir, rank)
    if not path.exists():
        return None
    return dict(json.loads(path.read_text(encoding="utf-8")))


def error_report(error: BaseException, traceback_text: str, when: float) -> dict[str, Any]:
    # bad input found in a worker exits 2, as it would have before launch
    exit_code = error.exit_code if isinstance(error, CrosstrainError) else 1
    return {
        "message": error_summary(error),
        "traceback": traceback_text,
        "time": when,
        "exit_code": exit_code,
    }


def error_summary(error: BaseException) -> str:
    """One line for the error message; the traceback carries the rest. TensorFlow's
    errors open with "in user code:" and end with the real cause, so take the last line then."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = (lines[-1] if lines[0].endswith(":") else lines[0]) if lines else ""
    kind = type(error).__name__
    if isinstance(error, CrosstrainError) or line.startswith(f"{kind}:"):
        return line
    return f"{kind}: {line}" if line else kind


def blame_order(code: int | None, reported_at: float | None) -> tuple[int, float]:
    """Sort key of a failed rank, the likeliest cause first. A rank that dies abruptly (a
    signal or a crash in native code, no report) comes first: its peers only report the
    collectives it broke. Then the earliest report, for the same reason. Last a rank that
    aborted itself (SIGABRT): gloo's and NCCL's error paths abort a process whose peer
    vanished, so an abort is most often the echo of a peer's death in the same instant."""
    if reported_at is not None:
        return (1, reported_at)
    if code == -signal.SIGABRT:
        return _ECHO
    return (0, 0.0)


#: :func:`blame_order` of a rank that aborted itself without a report
_ECHO = (2, 0.0)


def only_echoes(failed: Sequence[int], codes: Mapping[int, int | None], run_dir: Path) -> bool:
    """Every failed rank aborted itself without a report: likely echoes of a peer's death
    (:func:`blame_order`), not yet a cause to name."""
    return all(
        blame_order(codes.get(rank), None) == _ECHO and read_error(run_dir, rank) is None for rank in failed
    )


def first_failure(failed: Sequence[int], codes: Mapping[int, int | None], run_dir: Path) -> WorkerError:
    """The failure that caused the others (:func:`blame_order`)."""
    reports = {rank: report for rank in codes if (report := read_error(run_dir, rank)) is not None}

    def order(rank: int) -> tuple[tuple[int, float], int]:
        report = reports.get(rank)
        return blame_order(codes.get(rank), None if report is None else float(report["time"])), rank

    rank = min({*failed, *reports}, key=order)
    report = reports.get(rank)
    if report is None:
        return WorkerError(rank, describe_exit(codes.get(rank)))
    return WorkerError(
        rank, str(report["message"]), str(report["traceback"]), exit_code=int(report.get("exit_code", 1))
    )


def log_failure(error: WorkerError, run_folder: Path) -> None:
    """Add ``error``'s traceback to the run folder's :data:`ERROR_LOG`, under a line with the
    time and the error's sentence, and set ``error.log`` to it. Appended: a run restarted
    (``--max-restarts``) or resumed keeps the tracebacks of its earlier failures. A failure
    without a traceback (a killed rank, a stall) has nothing to add."""
    if not error.traceback_text:
        return
    path = Path(run_folder) / ERROR_LOG
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        with path.open("a", encoding="utf-8") as log:
            log.write(f"{when} {error}\n{error.traceback_text.rstrip()}\n\n")
    except OSError:  # a folder that vanished or went read-only: the terminal still has the line
        return
    error.log = path


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    if code == 0:
        return "exited without reporting a result"
    return f"exited with code {code}"
