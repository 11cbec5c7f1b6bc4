"""Built-in plugin ``metrics``: metrics.jsonl (one line per step and per evaluation) and
summary.json, written by rank 0 and flushed line by line so a crash loses nothing."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write null for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _clean(item) for key, item in value.items()}
    return value


class MetricsWriter:
    def __init__(self) -> None:
        self._stream: IO[str] | None = None

    def _write(self, record: Mapping[str, Any]) -> None:
        if self._stream is not None:
            self._stream.write(json.dumps(_clean(record)) + "\n")
            self._stream.flush()

    @hookimpl
    def crosstrain_train_start(self, context: RunContext) -> None:
        if context.world.is_main:
            context.out_dir.mkdir(parents=True, exist_ok=True)
            path = context.out_dir / METRICS_FILE
            # a resumed (or restarted) run: keep the lines up to its checkpoint's step, so the
            # file shows each step once; the run folder is never reused otherwise
            keep_through(path, context.start_step)
            self._stream = path.open("a", encoding="utf-8")

    @hookimpl
    def crosstrain_step_end(
        self, context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
    ) -> None:
        self._write({"step": step, "epoch": epoch, "lr": lr, **metrics})

    @hookimpl
    def crosstrain_eval_end(
        self, context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]
    ) -> None:
        self._write({"step": step, "epoch": epoch, "eval": dict(metrics)})

    @hookimpl
    def crosstrain_train_end(self, context: RunContext, summary: Mapping[str, Any]) -> None:
        if context.world.is_main:
            path: Path = context.out_dir / SUMMARY_FILE
            path.write_text(json.dumps(_clean(summary), indent=2) + "\n", encoding="utf-8")
        self._close()

    @hookimpl
    def crosstrain_exception(self, context: RunContext, rank: int, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def keep_through(path: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (written before a failure), atomically."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(temporary, path)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The records of the last run written to ``folder/metrics.jsonl``.

    The file is appended to: a run repeated into the same folder starts again at a lower
    step. The last run is the one summary.json describes."""
    lines = (folder / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    start, previous = 0, 0
    for index, record in enumerate(records):
        if "eval" not in record and record.get("step", 0) <= previous:
            start = index
        previous = record.get("step", previous)
    return records[start:]


# The entry point names this instance ("crosstrain.plugins.metrics:plugin").
plugin = MetricsWriter()
