"""A test plugin (`-p tests.recording_plugin`): every lifecycle call, per rank, as JSON lines in
$CROSSTRAIN_TEST_RECORD_DIR/rank{N}.jsonl."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import crosstrain
from crosstrain.core.run.context import RunContext


def _record(context: RunContext, hook: str, **arguments: Any) -> None:
    folder = Path(os.environ["CROSSTRAIN_TEST_RECORD_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    line = {
        "hook": hook,
        "rank": context.world.rank,
        "is_main": context.world.is_main,
        "replicas": context.world.replicas,
        "backend": context.backend,
        **arguments,
    }
    with (folder / f"rank{context.world.rank}.jsonl").open("a") as stream:
        stream.write(json.dumps(line, default=str) + "\n")


@crosstrain.hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    _record(context, "train_start", total_steps=context.total_steps)


@crosstrain.hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    _record(context, "step_end", step=step, epoch=epoch, lr=lr, loss=metrics["loss"])


@crosstrain.hookimpl
def crosstrain_eval_end(context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
    _record(context, "eval_end", step=step, epoch=epoch, metrics=dict(metrics))


@crosstrain.hookimpl
def crosstrain_epoch_end(context: RunContext, epoch: int, metrics: Mapping[str, float]) -> None:
    _record(context, "epoch_end", epoch=epoch)


@crosstrain.hookimpl
def crosstrain_checkpoint_saved(context: RunContext, path: str, step: int) -> None:
    _record(context, "checkpoint_saved", path=path, step=step)


@crosstrain.hookimpl
def crosstrain_train_end(context: RunContext, summary: Mapping[str, Any]) -> None:
    _record(context, "train_end", steps=summary["steps"])


@crosstrain.hookimpl
def crosstrain_exception(context: RunContext, rank: int, error: BaseException) -> None:
    _record(context, "exception", error_rank=rank, error=repr(error))
