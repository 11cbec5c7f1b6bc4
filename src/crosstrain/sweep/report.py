"""What a sweep leaves at its end: the table of its trials, ``best.toml`` (the plan with the
best trial's values) and ``sweep.png`` (each trial's objective, and the best so far)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomlkit
from rich.table import Table

from crosstrain.core.admission.runfolder import read_run_plan
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.plan_dicts import unstructure_plan
from crosstrain.sweep.study import TRIALS_DIR
from crosstrain.sweep.trials import shown

BEST_FILE, PLOT_FILE = "best.toml", "sweep.png"
PLOT_INCHES, PLOT_DPI = (8.0, 4.5), 100


def trials_table(study: Any, objective: str) -> Table:
    table = Table(title=f"sweep: {len(study.trials)} trials, {objective} ({study.direction.name.lower()})")
    for column in ("trial", "state", objective, "values"):
        table.add_column(column, justify="right" if column != "values" else "left")
    best = _best_number(study)
    for trial in study.trials:
        value = "" if trial.value is None else f"{trial.value:.6g}"
        mark = " *" if trial.number == best else ""
        table.add_row(f"{trial.number}{mark}", trial.state.name.lower(), value, shown(trial.params))
    return table


def _best_number(study: Any) -> int | None:
    try:
        return int(study.best_trial.number)
    except ValueError:  # no complete trial yet
        return None


def write_best_plan(study: Any, sweep_dir: Path) -> Path | None:
    """The best trial's plan (as it ran: its run folder's plan.json) as TOML."""
    number = _best_number(study)
    if number is None:
        return None
    plan = read_run_plan(sweep_dir / TRIALS_DIR / str(number))
    comment = f"The best trial ({number}) of the sweep in {sweep_dir}: {shown(study.best_params)}"
    document = plan_document(plan, comment)
    path = sweep_dir / BEST_FILE
    path.write_text(tomlkit.dumps(document), encoding="utf-8")
    return path


def plan_document(plan: Plan, comment: str) -> tomlkit.TOMLDocument:
    """``plan`` as a TOML document, headed by ``comment``."""
    document = tomlkit.document()
    document.add(tomlkit.comment(comment))
    for key, value in _without_none(unstructure_plan(plan)).items():
        document.add(key, value)
    return document


def _without_none(raw: Mapping[str, Any]) -> dict[str, Any]:
    """TOML has no null: a field left at None is left out (its default)."""
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            value = _without_none(value)
        elif isinstance(value, list):
            value = [_without_none(item) if isinstance(item, Mapping) else item for item in value]
        if value is not None:
            kept[key] = value
    return kept


def draw_sweep(study: Any, sweep_dir: Path, objective: str) -> Path | None:
    """Each complete trial's objective and the best so far, by trial number; None without
    matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [(trial.number, trial.value) for trial in study.trials if trial.value is not None]
    figure = Figure(figsize=PLOT_INCHES, dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    if done:
        numbers, values = zip(*done, strict=True)
        pick = min if study.direction.name == "MINIMIZE" else max
        best = [pick(values[: index + 1]) for index in range(len(values))]
        axes.plot(numbers, values, "o", label="trial")
        axes.step(numbers, best, where="post", label="best so far")
        axes.legend()
        if (
            all(value > 0 for value in values)
            and max(values) / min(values) > 10
            and math.isfinite(max(values))
        ):
            axes.set_yscale("log")
    axes.set_xlabel("trial")
    axes.set_ylabel(objective)
    axes.set_title(f"sweep of {sweep_dir.name}")
    path = sweep_dir / PLOT_FILE
    figure.savefig(path, dpi=PLOT_DPI)
    return path
