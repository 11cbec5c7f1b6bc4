"""The errors crosstrain reports to users: one clear line, a chosen exit code, no traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

#: the exit code of bad input (a plan field, a data file, a command-line value), before
#: launch or found by a worker
BAD_INPUT_EXIT_CODE = 2
#: the file in a run folder that receives the traceback of each worker that failed
ERROR_LOG = "error.log"


def closest_name(word: str, known: Iterable[str]) -> str | None:
    """The known name nearest to ``word`` (difflib's ratio, ignoring case, so Keras's
    ``MaxPooling2D`` finds ``maxpool2d``), or None when none is near."""
    by_lower = {name.lower(): name for name in known}
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=1)
    return by_lower[found[0]] if found else None


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """The tail of a refusal of an unknown name: ``"; did you mean 'dense'?"`` when a known
    name is near, else the known names, so the line always says what would do."""
    known = sorted(known)
    match = closest_name(word, known)
    return f"; did you mean {match!r}?" if match is not None else f" (known: {', '.join(known)})"


class CrosstrainError(Exception):
    """Base of every error the CLI turns into a message and an exit code."""

    exit_code: int = 1


class PlanError(CrosstrainError):
    """A plan that cannot run: names the file and the field at fault."""

    exit_code = 2

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.message = message  # without the file and field, for a caller that adds to it
        self.field = field
        self.source = source
        where = ": ".join(part for part in (source, field) if part)
        super().__init__(f"{where}: {message}" if where else message)


class BackendError(CrosstrainError):
    """An unknown backend, a missing framework, or two plugins claiming one name."""

    exit_code = 2


class WorkerError(CrosstrainError):
    """A worker (rank) failed; carries that rank's traceback so it is shown exactly once,
    and ``log``, the run folder's file the launcher wrote it to (None when none was)."""

    exit_code = 1

    def __init__(self, rank: int | None, message: str, traceback_text: str = "", *, exit_code: int = 1):
        self.rank = rank
        self.traceback_text = traceback_text
        self.exit_code = exit_code  # 2 when the worker found bad input (a PlanError), as before launch
        self.log: Path | None = None
        super().__init__(self._sentence(rank, message))

    @property
    def bad_input(self) -> bool:
        """The worker refused its input (an error of exit code 2, such as a damaged image):
        its line names the cause, so its traceback is for the log, not the terminal."""
        return self.exit_code == BAD_INPUT_EXIT_CODE

    @staticmethod
    def _sentence(rank: int | None, message: str) -> str:
        who = f"rank {rank}" if rank is not None else "a worker"
        return f"{who} failed: {message}"


class WorkerStalled(WorkerError):
    """A rank made no progress (no heartbeat) for the job's timeout; every worker was stopped."""

    def __init__(self, rank: int, silent_seconds: float, step: int | None, timeout_seconds: float):
        self.step = step
        where = f"after step {step}" if step is not None else "after starting"
        super().__init__(
            rank,
            f"made no progress for {int(silent_seconds)} s {where} "
            f"(--timeout {timeout_seconds:g}); every worker was stopped",
        )

    @staticmethod
    def _sentence(rank: int | None, message: str) -> str:
        return f"rank {rank} {message}"


class InputError(CrosstrainError):
    """Bad input outside the plan: a command-line value, a data file, the output folder."""

    exit_code = 2


class Interrupted(CrosstrainError):
    """SIGINT or SIGTERM reached the launcher: every worker was stopped. Exits 128 + the signal
    (130, 143), as a shell reports a process the signal ended."""

    def __init__(self, signal_number: int):
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number
        super().__init__("interrupted")


# --------------------------------------------------------------------------- raised by one part each


class CheckpointError(CrosstrainError):
    """A run folder whose checkpoints cannot be resumed from (missing, from another plan)."""

    exit_code = 2


class RunFolderError(CrosstrainError):
    """A run folder that cannot be used as asked: in use, already used, nothing to resume."""

    exit_code = 2


class NonFiniteLossError(CrosstrainError):
    """Training met a non-finite loss (``train.on_nonfinite = "stop"``) and ended there."""

    exit_code = 1


class PluginError(CrosstrainError):
    """A plugin named with ``-p`` that does not load, or one that implements a hook that
    does not exist: refused before any process starts."""

    exit_code = 2


class TensorboardError(CrosstrainError):
    """--tensorboard was asked for, but no installed framework can write event files."""

    exit_code = 2


class RunDirError(CrosstrainError):
    """A folder given to ``crosstrain plot`` that holds no run to plot."""

    exit_code = 2
