"""Built-in plugin ``tensorboard``: ``crosstrain run ... --tensorboard [DIR]``.

Rank 0 writes TensorBoard event files of the step loss, the learning rate and the
eval metrics, through the event writer of a framework that is installed: the one
this process already imported first (the running backend's), then any other that
imports. Nothing here asks which backend runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from crosstrain.core.errors import TensorboardError
from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

OPTION = "tensorboard"  # the argparse dest, hence the key in context.options
DEFAULT_SUBDIR = "tensorboard"
# Tags written; eval metrics are written as eval/<name> (all but the row count).
TRAIN_LOSS_TAG, LEARNING_RATE_TAG = "train/loss", "train/lr"
_NOT_WRITTEN = frozenset({"count"})


class ScalarWriter(Protocol):
    def scalar(self, tag: str, value: float, step: int) -> None: ...

    def close(self) -> None: ...


class TorchScalarWriter:
    """torch.utils.tensorboard; it needs the ``tensorboard`` package beside torch."""

    def __init__(self, log_dir: Path) -> None:
        # tensorboard imports tensorflow when it is installed: keep its start-up logs quiet
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class TensorflowScalarWriter:
    """tf.summary's file writer; tensorflow ships it (no tensorboard package needed)."""

    def __init__(self, log_dir: Path) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        self._summary = tf.summary
        self._writer = tf.summary.create_file_writer(str(log_dir))

    def scalar(self, tag: str, value: float, step: int) -> None:
        with self._writer.as_default():
            self._summary.scalar(tag, value, step=step)

    def close(self) -> None:
        self._writer.close()


MISSING_WRITER = (
    "--tensorboard needs torch with the tensorboard package (pip install 'crosstrain[tensorboard]') "
    "or tensorflow (pip install 'crosstrain[tf]')"
)


def writer_installed() -> bool:
    """Whether some writer can open, found without importing a framework: torch's writer
    needs the tensorboard package beside torch, tf.summary needs only tensorflow."""
    found = {module: importlib.util.find_spec(module) is not None for module in ("torch", "tensorboard")}
    return all(found.values()) or importlib.util.find_spec("tensorflow") is not None


#: framework module -> its writer; tried in this order among equals
WRITERS: Mapping[str, Callable[[Path], ScalarWriter]] = {
    "torch": TorchScalarWriter,
    "tensorflow": TensorflowScalarWriter,
}


def open_scalar_writer(log_dir: Path) -> ScalarWriter:
    """The first writer that opens, trying frameworks this process already imported first:
    the running backend's framework is the cheap and natural choice."""
    order = sorted(WRITERS, key=lambda module: module not in sys.modules)
    problems: list[str] = []
    for module in order:
        try:
            return WRITERS[module](log_dir)
        except ImportError as error:
            problems.append(f"{module}: {error}")
    raise TensorboardError(f"{MISSING_WRITER}; none imports ({'; '.join(problems)})")


def log_dir_for(context: RunContext) -> Path | None:
    """Where to write, or None when --tensorboard was not given."""
    value = context.options.get(OPTION)
    if value is None or value is False:
        return None
    if value is True or value == "":
        return context.out_dir / DEFAULT_SUBDIR
    return Path(value)


class _LogDirAction(argparse.Action):
    """Stores the folder, absolute (workers may not share the CLI's working directory; "":
    no DIR given), once a writer is known to be installed: a missing package is refused
    here, before any process starts, not at the first step."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        if not writer_installed():
            needs = MISSING_WRITER.removeprefix("--tensorboard ")
            raise argparse.ArgumentError(self, f"{needs}; neither is installed")
        setattr(namespace, self.dest, str(Path(values).resolve()) if values else "")


class TensorboardLogger:
    """The plugin's state in this process; only rank 0 opens a writer."""

    def __init__(self) -> None:
        self._writer: ScalarWriter | None = None

    def start(self, context: RunContext) -> None:
        self.close()
        log_dir = log_dir_for(context)
        if log_dir is not None and context.world.is_main:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = open_scalar_writer(log_dir)

    def step(self, step: int, lr: float, metrics: Mapping[str, float]) -> None:
        if self._writer is not None:
            self._writer.scalar(TRAIN_LOSS_TAG, metrics["loss"], step)
            self._writer.scalar(LEARNING_RATE_TAG, lr, step)

    def evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            if name not in _NOT_WRITTEN:
                self._writer.scalar(f"eval/{name}", value, step)

    def close(self) -> None:
        """Flush and close: events written so far are kept, also when training failed."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


_logger = TensorboardLogger()


@hookimpl
def crosstrain_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensorboard")
    group.add_argument(
        "--tensorboard",
        dest=OPTION,
        nargs="?",
        const="",
        default=None,
        action=_LogDirAction,
        metavar="DIR",
        help="write TensorBoard event files (step loss, lr, eval metrics) to DIR "
        "(default: OUT_DIR/tensorboard); put it after the plan file",
    )


@hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    _logger.start(context)


@hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    _logger.step(step, lr, metrics)


@hookimpl
def crosstrain_eval_end(context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
    _logger.evaluation(step, metrics)


@hookimpl
def crosstrain_train_end(context: RunContext, summary: Mapping[str, Any]) -> None:
    _logger.close()


@hookimpl
def crosstrain_exception(context: RunContext, rank: int, error: BaseException) -> None:
    _logger.close()
