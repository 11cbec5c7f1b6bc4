"""A tracker whose metrics fail at their second batch (a full disk, a server gone), as a
crosstrain plugin: ``-p tests.tracking.failing_tracker --failing``. It notes each call in
the run folder's ``failing-tracker.log``, so a test sees what was asked of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crosstrain.core.run.context import RunContext
from crosstrain.tracking.base import TrackerOption, TrackerPlugin


class FailingRun:
    def __init__(self, context: RunContext, given: str, run_id: str | None) -> None:
        self.run_id = "failing-1"
        self._log = context.out_dir / "failing-tracker.log"
        self._batches = 0
        self._note("open")

    def _note(self, what: str) -> None:
        with self._log.open("a") as log:
            log.write(what + "\n")

    def log_params(self, params: Mapping[str, str]) -> None:
        self._note("params")

    def log_metrics(self, steps: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        self._batches += 1
        self._note(f"metrics {self._batches}")
        if self._batches == 2:
            raise OSError(28, "No space left on device")

    def log_artifacts(self, files: Sequence[Path], summary: Mapping[str, Any]) -> None:
        self._note("artifacts")

    def close(self, failed: bool) -> None:
        self._note(f"close failed={failed}")


plugin = TrackerPlugin(
    "failing",
    "a failing tracker",
    TrackerOption(module="json", extra="none", metavar="X", help="fail"),
    FailingRun,
)
# -p NAME registers this module: its hooks are the instance's
globals().update({name: getattr(plugin, name) for name in dir(plugin) if name.startswith("crosstrain_")})
