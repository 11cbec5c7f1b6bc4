"""`crosstrain compare`: one plan on several backends, per-step losses side by side, and a verdict.

Each backend runs into its own subfolder of the compare folder; ``compare.json`` there lists
them in order (the reference first), so ``crosstrain plot COMPARE_DIR`` draws them all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from rich.console import Console
from rich.table import Table

from crosstrain.api import LaunchOptions, make_job, run_job
from crosstrain.core.admission import admit
from crosstrain.core.errors import CrosstrainError, InputError
from crosstrain.core.plan import Plan
from crosstrain.core.strategy import DeviceChoice, PluginSelection
from crosstrain.launch.environments import detect_environment
from crosstrain.plugins.manager import CrosstrainPluginManager, get_backend
from crosstrain.plugins.metrics import METRICS_FILE, read_metrics

COMPARE_FILE = "compare.json"
# compare reads each run's per-step losses from what this plugin writes
METRICS_PLUGIN = "metrics"


@attrs.frozen
class BackendRun:
    backend: str
    summary: Mapping[str, Any]
    losses: np.ndarray


@attrs.frozen
class Comparison:
    """How a candidate run differs from the reference (the first backend)."""

    reference: BackendRun
    candidate: BackendRun
    max_relative_loss_difference: float
    worst_step: int
    eval_relative_loss_difference: float
    accuracy_difference: float

    def agrees(self, tolerance: float, accuracy_tolerance: float) -> bool:
        return (
            self.max_relative_loss_difference <= tolerance
            and self.eval_relative_loss_difference <= tolerance
            and self.accuracy_difference <= accuracy_tolerance
        )


def read_step_losses(run_dir: Path) -> np.ndarray:
    """Per-optimizer-step losses of the last run in ``run_dir``, in step order."""
    records = read_metrics(run_dir)
    return np.array([record["loss"] for record in records if "loss" in record and "eval" not in record])


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare_pair(reference: BackendRun, candidate: BackendRun) -> Comparison:
    if reference.losses.shape != candidate.losses.shape:
        difference, worst = float("inf"), min(len(reference.losses), len(candidate.losses))
    else:
        relative = np.abs(candidate.losses - reference.losses) / np.maximum(np.abs(reference.losses), 1e-12)
        worst = int(np.argmax(relative)) + 1 if relative.size else 0
        difference = float(relative.max()) if relative.size else 0.0
    reference_eval, candidate_eval = reference.summary.get("eval", {}), candidate.summary.get("eval", {})
    eval_difference = (
        _relative(candidate_eval["loss"], reference_eval["loss"])
        if "loss" in reference_eval and "loss" in candidate_eval
        else 0.0
    )
    accuracy_difference = abs(candidate_eval.get("accuracy", 0.0) - reference_eval.get("accuracy", 0.0))
    return Comparison(reference, candidate, difference, worst, eval_difference, accuracy_difference)


def run_backends(
    plan: Plan,
    backends: Sequence[str],
    manager: CrosstrainPluginManager,
    out_root: Path,
    replicas: int | None = 1,
    workers: int | None = None,
    device: DeviceChoice = "auto",
    plugins: PluginSelection = PluginSelection(),
    timeout_seconds: float = 300.0,
) -> list[BackendRun]:
    """Run the plan once per backend, each into ``out_root/BACKEND``."""
    if len(backends) < 2:
        raise CrosstrainError("compare needs at least two backends, e.g. --backends torch,tf")
    if METRICS_PLUGIN in plugins.disabled:
        raise InputError(
            f"compare reads each run's per-step losses from {METRICS_FILE}, which the "
            f"{METRICS_PLUGIN!r} plugin writes: drop -p no:{METRICS_PLUGIN}"
        )
    jobs = []
    folders = run_folders(backends)
    cluster = detect_environment()
    for backend, folder in zip(backends, folders, strict=True):
        options = LaunchOptions(
            backend=backend,
            replicas=replicas,
            workers=workers,
            device=device,
            out=out_root / folder,
            plugins=plugins,
            timeout_seconds=timeout_seconds,
        )
        job = make_job(plan, options, cluster)
        # every backend must exist and accept the plan before the first run starts
        admit(job, get_backend(manager, backend)(), cluster)
        jobs.append(job)
    write_compare_file(out_root, plan, backends, folders)
    runs = []
    for job in jobs:
        backend = job.backend
        summary = run_job(job, manager)
        runs.append(BackendRun(backend, summary, read_step_losses(Path(job.out_dir))))
    return runs


def run_folders(backends: Sequence[str]) -> list[str]:
    """Each backend's subfolder: its name, or name-index where one backend runs twice (a
    determinism check must not share, and append to, one folder)."""
    return [
        backend if backends.count(backend) == 1 else f"{backend}-{index}"
        for index, backend in enumerate(backends)
    ]


def write_compare_file(out_root: Path, plan: Plan, backends: Sequence[str], folders: Sequence[str]) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    runs = [{"backend": backend, "folder": folder} for backend, folder in zip(backends, folders, strict=True)]
    text = json.dumps({"plan": plan.name, "runs": runs}, indent=2) + "\n"
    (out_root / COMPARE_FILE).write_text(text, encoding="utf-8")


def compare_run_folders(folder: Path) -> list[Path] | None:
    """The run folders of a compare folder, the reference first; None when ``folder`` is
    not one."""
    path = folder / COMPARE_FILE
    if not path.is_file():
        return None
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
        return [folder / str(run["folder"]) for run in runs]
    except (ValueError, KeyError, TypeError) as error:
        raise InputError(f"{path}: not a compare file ({type(error).__name__}: {error})") from None


def print_comparison(
    console: Console,
    runs: Sequence[BackendRun],
    comparisons: Sequence[Comparison],
    tolerance: float,
    accuracy_tolerance: float,
) -> bool:
    """Print the side-by-side table and the verdict; return whether every backend agrees."""
    table = Table(title=f"compare: {', '.join(run.backend for run in runs)}")
    table.add_column("")
    for run in runs:
        table.add_column(run.backend, justify="right")
    rows: list[tuple[str, Any]] = [
        ("steps", lambda r: f"{len(r.losses)}"),
        ("final train loss", lambda r: f"{r.summary['train']['loss']:.6f}"),
        ("eval loss", lambda r: f"{r.summary.get('eval', {}).get('loss', float('nan')):.6f}"),
        ("eval accuracy", lambda r: f"{r.summary.get('eval', {}).get('accuracy', float('nan')):.4f}"),
        ("samples/s", lambda r: f"{r.summary['samples_per_second']:.0f}"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(run) for run in runs))
    table.add_row(
        "max rel. step-loss diff",
        "-",
        *(f"{c.max_relative_loss_difference:.2e} (step {c.worst_step})" for c in comparisons),
    )
    table.add_row(
        "eval loss rel. diff", "-", *(f"{c.eval_relative_loss_difference:.2e}" for c in comparisons)
    )
    console.print(table)
    agree = all(c.agrees(tolerance, accuracy_tolerance) for c in comparisons)
    verdict = "AGREE" if agree else "DISAGREE"
    console.print(
        f"verdict: {verdict} (step-loss and eval-loss tolerance {tolerance:g} relative, "
        f"accuracy tolerance {accuracy_tolerance:g})",
        markup=False,
        soft_wrap=True,
    )
    return agree
