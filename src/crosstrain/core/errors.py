"""The errors crosstrain reports to users: one clear line, a chosen exit code, no traceback."""

from __future__ import annotations


class CrosstrainError(Exception):
    """Base of every error the CLI turns into a message and an exit code."""

    exit_code: int = 1


class PlanError(CrosstrainError):
    """A plan that cannot run: names the file and the field at fault."""

    exit_code = 2

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.field = field
        self.source = source
        where = ": ".join(part for part in (source, field) if part)
        super().__init__(f"{where}: {message}" if where else message)


class BackendError(CrosstrainError):
    """An unknown backend, a missing framework, or two plugins claiming one name."""

    exit_code = 2


class WorkerError(CrosstrainError):
    """A worker (rank) failed; carries that rank's traceback so it is shown exactly once."""

    exit_code = 1

    def __init__(self, rank: int | None, message: str, traceback_text: str = ""):
        self.rank = rank
        self.traceback_text = traceback_text
        who = f"rank {rank}" if rank is not None else "a worker"
        super().__init__(f"{who} failed: {message}")
