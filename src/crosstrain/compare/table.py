"""The report: the reference and the candidates side by side in a rich table (their final
metrics, the seed spread, the agreement horizon and the growth after it), then the verdict
line."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from crosstrain.compare.difference import EARLY_STEPS, BackendRun, ComparedRuns, Comparison, comparisons_of
from crosstrain.compare.spread import MetricSpread, metric_value, seed_spreads, seeds_text
from crosstrain.compare.verdict import Verdict, early_bound, judge

#: the widest a table may be printed into a pipe or a log, unwrapped
UNWRAPPED_WIDTH = 400


def _horizon_cell(comparison: Comparison) -> str:
    if comparison.leaves_at is None:
        return f"all {comparison.steps} steps"
    return f"step {comparison.horizon} of {comparison.steps}"


def _growth_cell(comparison: Comparison) -> str:
    points = comparison.growth()
    return ", ".join(f"{step}: {value:.0e}" for step, value in points) if points else "-"


def _spread_cell(spreads: Sequence[MetricSpread], label: str) -> str:
    for spread in spreads:
        if spread.label == label:
            return f"{spread.low:.4f}..{spread.high:.4f}"
    return "-"


def _fp64_cell(comparison: Comparison) -> str:
    """The candidate's fp64 steps 1-2 difference and the bound rounding gives it."""
    found, bound = comparison.fp64_difference(), early_bound(comparison)
    if found is None or bound is None:
        return "no probe"
    return f"{found[1]:.1e} (<={bound:.1e})"


def print_comparison(
    console: Console,
    runs: ComparedRuns,
    tolerance: float,
    accuracy_tolerance: float,
) -> Verdict:
    """Print the side-by-side table and the verdict line; return the verdict."""
    comparisons = comparisons_of(runs, tolerance)
    spreads = seed_spreads(runs.reference, runs.seed_runs)
    seeds = [runs.reference.seed, *(run.seed for run in runs.seed_runs)]
    verdict = judge(comparisons, spreads, seeds, accuracy_tolerance)
    shown = [runs.reference, *runs.candidates]
    table = Table(title=f"compare: {', '.join(run.name for run in shown)}")
    table.add_column("")
    for run in shown:
        table.add_column(run.name, justify="right")
    if spreads:
        table.add_column(f"{runs.reference.name} seeds {seeds_text(seeds)}", justify="right")
    _add_run_rows(table, shown, spreads)
    _add_comparison_rows(table, comparisons, verdict, bool(spreads))
    # in a pipe or a log, the table at its natural width: wrapped cells would split numbers
    _print_unwrapped(console, table)
    console.print(verdict.line, markup=False, soft_wrap=True)
    return verdict


def _print_unwrapped(console: Console, table: Table) -> None:
    """On a terminal, the table as wide as the terminal; in a pipe or a log (80 columns to
    rich) at its natural width: wrapped cells would split numbers."""
    if console.is_terminal:
        console.print(table)
        return
    unbounded = console.options.update(max_width=UNWRAPPED_WIDTH)
    width = max(console.width, Measurement.get(console, unbounded, table).maximum)
    Console(file=console.file, width=width, highlight=False).print(table)


def _add_run_rows(table: Table, shown: Sequence[BackendRun], spreads: Sequence[MetricSpread]) -> None:
    def value(section: str, key: str, digits: int) -> Callable[[BackendRun], str]:
        def cell(run: BackendRun) -> str:
            found = metric_value(run.summary, section, key)
            return "-" if found is None else f"{found:.{digits}f}"

        return cell

    rows: list[tuple[str, Callable[[BackendRun], str]]] = [
        ("steps", lambda run: f"{len(run.losses)}"),
        ("final train loss", value("train", "loss", 6)),
        ("eval loss", value("eval", "loss", 6)),
        ("eval accuracy", value("eval", "accuracy", 4)),
        ("samples/s", lambda run: f"{run.summary.get('samples_per_second', float('nan')):.0f}"),
    ]
    for label, cell in rows:
        extra = [_spread_cell(spreads, label)] if spreads else []
        table.add_row(label, *(cell(run) for run in shown), *extra)


def _add_comparison_rows(
    table: Table, comparisons: Sequence[Comparison], verdict: Verdict, seeded: bool
) -> None:
    rows: list[tuple[str, Callable[[Comparison], str]]] = [
        (f"agreement horizon ({comparisons[0].tolerance:g})", _horizon_cell),
        ("then (step: rel. diff)", _growth_cell),
        ("max rel. step-loss diff", lambda c: f"{c.max_relative_loss_difference:.2e} (step {c.worst_step})"),
        (f"steps 1-{EARLY_STEPS} rel. diff", lambda c: f"{c.early_difference()[1]:.1e}"),
        (f"steps 1-{EARLY_STEPS} in fp64 (bound)", _fp64_cell),
        ("eval loss rel. diff", lambda c: f"{c.eval_relative_loss_difference:.2e}"),
        ("verdict", lambda c: verdict.per_candidate[c.candidate.name]),
    ]
    for label, cell in rows:
        table.add_row(label, "-", *(cell(c) for c in comparisons), *(["-"] if seeded else []))
