"""Built-in plugin ``progress``: what rank 0 shows while it trains.

On a terminal, a rich progress bar (step/total, epoch, loss, lr, samples/s, MFU, ETA);
anywhere else (a pipe, a CI log), plain lines every ~10 % of the steps, with no
escape codes. In both, one line per epoch stays printed. MFU (model FLOPs utilisation,
:mod:`crosstrain.plugins.mfu`) is shown where the model's FLOPs and the device's peak are
known: a listed GPU, or ``--peak-tflops``. Workers are processes of
their own, so the choice is made in rank 0's process, from its own stdout.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)

from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl
from crosstrain.plugins.mfu import Utilisation

#: plain mode prints a step line about this many times per run
PLAIN_LINES_PER_RUN = 10


def format_mfu(utilisation: Utilisation | None, samples_per_second: float) -> str:
    """``  MFU 41.2%``, or nothing where it is not known."""
    return "" if utilisation is None else f"  MFU {100 * utilisation.mfu(samples_per_second):.1f}%"


def format_epoch_line(
    context: RunContext, epoch: int, metrics: Mapping[str, float], utilisation: Utilisation | None = None
) -> str:
    parts = [f"epoch {epoch + 1}/{context.epochs}", f"loss {metrics['loss']:.4f}"]
    if "eval_loss" in metrics:
        parts.append(f"eval_loss {metrics['eval_loss']:.4f}")
    if "eval_accuracy" in metrics:
        parts.append(f"eval_acc {metrics['eval_accuracy']:.4f}")
    parts.append(f"{metrics['samples_per_second']:.0f} samples/s")
    return "  ".join(parts) + format_mfu(utilisation, metrics["samples_per_second"])


def format_header(context: RunContext) -> str:
    """The run's first line: its seed (compare's seed runs tell apart by it), its length and
    what ends it, its layout, and how a resumed run continues
    (``digits_mlp (seed 0): 46 steps (2 epochs) on torch x2``)."""
    plan, world = context.plan, context.world
    line = (
        f"{plan.name} (seed {plan.seed}): {context.length.describe()} on {context.backend} x{world.replicas}"
    )
    resumed = context.resumed()
    return f"{line}, {resumed}" if resumed else line


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class Throughput:
    """Samples per second since the epoch began (evaluation excluded), and the ETA from the
    run's pace so far (the trackers log the same figure: crosstrain.tracking)."""

    def __init__(self, context: RunContext) -> None:
        self._rows_per_step = context.plan.train.global_batch_size
        self._total_steps = context.total_steps
        self._run_started = self._epoch_started = time.perf_counter()
        # a resumed run counts from its checkpoint's step
        self._first_step = self._last_step = self._epoch_first_step = context.start_step

    def record(self, step: int) -> None:
        self._last_step = step

    def next_epoch(self) -> None:
        self._epoch_started, self._epoch_first_step = time.perf_counter(), self._last_step

    def samples_per_second(self) -> float:
        elapsed = time.perf_counter() - self._epoch_started
        return (self._last_step - self._epoch_first_step) * self._rows_per_step / max(elapsed, 1e-9)

    def eta_seconds(self) -> float:
        elapsed = time.perf_counter() - self._run_started
        done = max(self._last_step - self._first_step, 1)
        return elapsed / done * (self._total_steps - self._last_step)


class _BarDisplay:
    """A rich bar on rank 0's terminal; epoch lines are printed above it and stay."""

    def __init__(self, context: RunContext) -> None:
        self._epochs = context.epochs
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[speed]} samples/s{task.fields[mfu]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=sys.stdout, highlight=False),
            transient=True,  # the bar goes when training ends; the epoch lines stay
        )
        self._task: TaskID = self._progress.add_task(
            self._description(0), total=context.total_steps, loss="-", lr="-", speed="-", mfu=""
        )
        self._progress.start()
        self.line(format_header(context))

    def _description(self, epoch: int) -> str:
        return f"epoch {epoch + 1}/{self._epochs}"

    def step(self, step: int, epoch: int, lr: float, loss: float, speed: float, mfu: str) -> None:
        self._progress.update(
            self._task,
            completed=step,
            description=self._description(epoch),
            loss=f"{loss:.4f}",
            lr=f"{lr:.2e}",
            speed=f"{speed:.0f}",
            mfu=mfu.replace("  ", ", "),
        )

    def line(self, text: str) -> None:
        self._progress.refresh()  # printing redraws the bar below the line: draw it up to date
        self._progress.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self._progress.stop()


class _PlainDisplay:
    """Plain lines for pipes and logs: a step line every ~10 % of the run."""

    def __init__(self, context: RunContext) -> None:
        self._epochs = context.epochs
        self._total_steps = context.total_steps
        self._every = max(1, math.ceil(context.total_steps / PLAIN_LINES_PER_RUN))
        self.line(format_header(context))

    def step(self, step: int, epoch: int, lr: float, loss: float, speed: float, mfu: str, eta: float) -> None:
        if step % self._every and step != self._total_steps:
            return
        percent = 100 * step / max(self._total_steps, 1)
        self.line(
            f"step {step}/{self._total_steps} ({percent:.0f}%)  epoch {epoch + 1}/{self._epochs}"
            f"  loss {loss:.4f}  lr {lr:.2e}  {speed:.0f} samples/s{mfu}"
            f"  eta {format_duration(eta)}"
        )

    def line(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        sys.stdout.flush()


class ProgressReporter:
    """The plugin's state in this process; only rank 0 ever opens a display."""

    def __init__(self) -> None:
        self._bar: _BarDisplay | None = None
        self._plain: _PlainDisplay | None = None
        self._throughput: Throughput | None = None
        self._utilisation: Utilisation | None = None

    def start(self, context: RunContext) -> None:
        self.close()
        if not context.world.is_main:
            return
        self._throughput = Throughput(context)
        self._utilisation = Utilisation.of(context, context.options.get(PEAK_OPTION))
        if sys.stdout.isatty():
            self._bar = _BarDisplay(context)
        else:
            self._plain = _PlainDisplay(context)

    def step(self, step: int, epoch: int, lr: float, metrics: Mapping[str, float]) -> None:
        if self._throughput is None:
            return
        self._throughput.record(step)
        speed = self._throughput.samples_per_second()
        mfu = format_mfu(self._utilisation, speed)
        if self._bar is not None:
            self._bar.step(step, epoch, lr, metrics["loss"], speed, mfu)
        if self._plain is not None:
            self._plain.step(step, epoch, lr, metrics["loss"], speed, mfu, self._throughput.eta_seconds())

    def epoch(self, context: RunContext, epoch: int, metrics: Mapping[str, float]) -> None:
        if self._throughput is None:  # not rank 0
            return
        self._throughput.next_epoch()
        text = format_epoch_line(context, epoch, metrics, self._utilisation)
        display = self._bar or self._plain
        if display is not None:
            display.line(text)

    def close(self) -> None:
        """Stop the bar (restoring the cursor) so nothing printed afterwards lands on it."""
        display = self._bar or self._plain
        self._bar = self._plain = self._throughput = None
        if display is not None:
            display.close()


_reporter = ProgressReporter()
PEAK_OPTION = "peak_tflops"


@hookimpl
def crosstrain_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("progress")
    group.add_argument(
        "--peak-tflops",
        dest=PEAK_OPTION,
        type=float,
        default=None,
        metavar="TFLOPS",
        help="each device's peak, for the MFU the progress line shows (default: a listed GPU's, "
        "for the run's precision); put it after the plan file",
    )


@hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    _reporter.start(context)


@hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    _reporter.step(step, epoch, lr, metrics)


@hookimpl
def crosstrain_epoch_end(context: RunContext, epoch: int, metrics: Mapping[str, float]) -> None:
    _reporter.epoch(context, epoch, metrics)


@hookimpl
def crosstrain_train_end(context: RunContext, summary: Mapping[str, Any]) -> None:
    _reporter.close()


@hookimpl
def crosstrain_exception(context: RunContext, rank: int, error: BaseException) -> None:
    _reporter.close()
