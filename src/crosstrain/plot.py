"""``crosstrain plot RUN_DIR [RUN_DIR ...] -o curves.png``: learning curves of finished runs.

Reads what the ``metrics`` plugin wrote (metrics.jsonl, summary.json) and draws, one
line per run, the train loss per step and the eval loss and accuracy per step; with two
runs or more, a fourth panel draws each run's |relative train-loss difference| from the
first run (the reference) per step on a log scale: where they agree to rounding, where
they leave the tolerance, how fast the difference grows. A ``crosstrain compare`` folder
stands for its runs (its seed runs are drawn but not differenced: they differ from the
first step by design). Each line is labelled by its run's folder. Needs matplotlib
(``pip install 'crosstrain[plot]'``), imported only when a plot is drawn.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from crosstrain.compare.folders import Role, compare_file_tolerance, compare_roles
from crosstrain.core.errors import CrosstrainError, RunDirError
from crosstrain.plugins.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from rich.console import Console

    from crosstrain.plugins.manager import CrosstrainPluginManager

FIGURE_INCHES = (15.0, 4.5)
FIGURE_DPI = 100  # with FIGURE_INCHES: a 1500 x 450 pixel PNG
# runs that train identically (world 1 vs world N) draw the same curve: vary the dash too
LINE_STYLES = ("-", "--", ":", "-.")
PANELS = (
    # (title, y label, marker) of each subplot, left to right; eval points are few: mark them
    ("train loss", "loss", ""),
    ("eval loss", "loss", "o"),
    ("eval accuracy", "accuracy", "o"),
)
#: the difference panel's title and y label, drawn with two runs or more (``{reference}``:
#: the first run's label)
DIFFERENCE_PANEL = ("|relative train-loss difference|", "from {reference}")
#: bit-equal steps (a difference of 0) are drawn on this floor of the log scale
DIFFERENCE_FLOOR = 1e-9


@attrs.frozen
class Curve:
    steps: tuple[int, ...]
    values: tuple[float, ...]


@attrs.frozen
class RunCurves:
    """One run's curves, read from its folder."""

    folder: Path
    plan: str
    train_loss: Curve
    eval_loss: Curve
    eval_accuracy: Curve


def _train_curve(records: list[dict[str, Any]]) -> Curve:
    points = [
        (int(record["step"]), float(record["loss"]))
        for record in records
        if "eval" not in record and record.get("loss") is not None
    ]  # null: a NaN loss
    return Curve(tuple(step for step, _ in points), tuple(value for _, value in points))


def _eval_curve(records: list[dict[str, Any]], name: str) -> Curve:
    points = [
        (int(record["step"]), float(record["eval"][name]))
        for record in records
        if record.get("eval", {}).get(name) is not None
    ]
    return Curve(tuple(step for step, _ in points), tuple(value for _, value in points))


def read_run(folder: str | Path) -> RunCurves:
    folder = Path(folder)
    metrics_path = folder / METRICS_FILE
    if not metrics_path.is_file():
        what = (
            "is not a folder"
            if not folder.is_dir()
            else f"has no {METRICS_FILE} (the 'metrics' plugin writes it: made with -p no:metrics?)"
        )
        raise RunDirError(f"{folder}: {what}; give the output folder of a crosstrain run or compare")
    records = read_metrics(folder)
    train_loss = _train_curve(records)
    if not train_loss.steps:
        raise RunDirError(f"{metrics_path}: holds no training step to plot")
    summary_path = folder / SUMMARY_FILE
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    return RunCurves(
        folder,
        str(summary.get("plan", "")),
        train_loss,
        _eval_curve(records, "loss"),
        _eval_curve(records, "accuracy"),
    )


def run_roles(folders: Sequence[str | Path]) -> list[tuple[Path, Role]]:
    """The run folders to draw with their roles: a compare folder's as its compare.json
    says; a plain run folder is the reference when it comes first, else a candidate."""
    runs: list[tuple[Path, Role]] = []
    for folder in map(Path, folders):
        members = None if (folder / METRICS_FILE).is_file() else compare_roles(folder)
        runs.extend(members if members is not None else [(folder, "candidate")])
    if runs:
        runs[0] = (runs[0][0], "reference")
    return runs


def relative_difference(reference: Curve, other: Curve) -> Curve:
    """|other - reference| / |reference| at the steps both have, floored at DIFFERENCE_FLOOR."""
    losses = dict(zip(reference.steps, reference.values, strict=True))
    points = [
        (step, max(abs(value - losses[step]) / max(abs(losses[step]), 1e-12), DIFFERENCE_FLOOR))
        for step, value in zip(other.steps, other.values, strict=True)
        if step in losses
    ]
    return Curve(tuple(step for step, _ in points), tuple(value for _, value in points))


def run_labels(folders: Sequence[str | Path], runs: Sequence[Path]) -> list[str]:
    """Each run by its folder, as a path from where the folders given lie: "x1", "x2" for
    two runs side by side, "cmp/torch", "cmp/tf" for a compare folder's runs."""
    if len(runs) == 1:
        return [runs[0].name]
    base = os.path.commonpath([Path(folder).resolve().parent for folder in folders])
    return [os.path.relpath(run.resolve(), base) for run in runs]


def _draw(axes: Axes, title: str, y_label: str, curves: list[tuple[str, Curve]], marker: str) -> None:
    for index, (label, curve) in enumerate(curves):
        if curve.steps:
            axes.plot(
                curve.steps,
                curve.values,
                marker=marker,
                linewidth=1.4,
                label=label,
                linestyle=LINE_STYLES[index % len(LINE_STYLES)],
            )
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(y_label)
    axes.grid(True, alpha=0.3)
    if axes.lines:
        axes.legend()


def _draw_differences(
    axes: Axes, reference: str, curves: list[tuple[str, Curve]], tolerance: float | None
) -> None:
    title, y_label = DIFFERENCE_PANEL
    _draw(axes, title, y_label.format(reference=reference), curves, "")
    axes.set_yscale("log")
    axes.set_ylim(bottom=DIFFERENCE_FLOOR)
    if tolerance is not None:
        axes.axhline(tolerance, color="grey", linestyle="--", linewidth=1.0, label=f"tolerance {tolerance:g}")
        axes.legend()


def check_matplotlib() -> None:
    """matplotlib is importable, else the error names the extra that brings it."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401 (imported to see that it can be)
    except ImportError as error:
        raise CrosstrainError(
            f"crosstrain plot needs matplotlib ({error}); pip install 'crosstrain[plot]'"
        ) from None


def build_figure(run_dirs: Sequence[str | Path]) -> Figure:
    """The figure ``plot_runs`` saves, for inspection: one subplot per entry of PANELS,
    and the difference panel when there are two runs or more."""
    check_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not run_dirs:
        raise RunDirError("crosstrain plot needs at least one run folder")
    # a compare's fp64 probes are two steps each: nothing to draw beside the curves
    roles = [(folder, role) for folder, role in run_roles(run_dirs) if role != "fp64"]
    folders = [folder for folder, _ in roles]
    runs = [read_run(folder) for folder in folders]
    labels = run_labels(run_dirs, folders)
    figure = Figure(figsize=FIGURE_INCHES, dpi=FIGURE_DPI, layout="constrained")
    FigureCanvasAgg(figure)  # draw with Agg: no display, no pyplot global state
    plans = sorted({run.plan for run in runs if run.plan})
    figure.suptitle(f"learning curves: {', '.join(plans)}" if plans else "learning curves")
    curves_by_panel = (
        [run.train_loss for run in runs],
        [run.eval_loss for run in runs],
        [run.eval_accuracy for run in runs],
    )
    panels = figure.subplots(1, len(PANELS) + (len(runs) > 1))
    for axes, (title, y_label, marker), curves in zip(panels, PANELS, curves_by_panel, strict=False):
        _draw(axes, title, y_label, list(zip(labels, curves, strict=True)), marker)
    if len(runs) > 1:
        differences = [
            (label, relative_difference(runs[0].train_loss, run.train_loss))
            for label, run, (_, role) in zip(labels[1:], runs[1:], roles[1:], strict=True)
            if role != "seed"
        ]
        tolerances = [compare_file_tolerance(Path(folder)) for folder in run_dirs]
        _draw_differences(panels[-1], labels[0], differences, next((t for t in tolerances if t), None))
    return figure


def plot_runs(run_dirs: Sequence[str | Path], output: str | Path) -> Path:
    """Draw the runs' learning curves into ``output`` (a PNG, or any format matplotlib
    writes, chosen by the suffix) and return its path."""
    figure = build_figure(run_dirs)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=FIGURE_DPI)
    return output


# --------------------------------------------------------------------------- command line


def _plot_command(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    path = plot_runs(args.runs, args.output)
    console.print(f"wrote {path}", markup=False, soft_wrap=True)
    return 0


def add_plot_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``crosstrain plot``: called by the CLI's parser builder."""
    plot = subparsers.add_parser("plot", help="draw learning curves of runs into an image")
    plot.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="output folders of crosstrain runs (or of a compare)"
    )
    plot.add_argument("-o", "--output", default="curves.png", help="image to write (default: curves.png)")
    plot.set_defaults(handler=_plot_command)
