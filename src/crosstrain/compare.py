"""`crosstrain compare`: one plan on several backends, per-step losses side by side, and a verdict.

Each backend runs into its own subfolder of the compare folder, and ``--seeds K`` runs the
reference backend (the first) K more times with seeds seed+1..seed+K; ``compare.json``
there lists every run with its role (the reference first), so ``crosstrain plot COMPARE_DIR``
draws them all and ``crosstrain compare COMPARE_DIR`` (or its run folders) judges them
again without training.

The verdict (docs/running.md#compare-agreement-horizon-and-seed-spread):

- AGREE: every candidate's per-step loss within ``tolerance`` (relative) of the reference's
  at every step, its eval loss too, its eval accuracy within ``accuracy_tolerance``;
- otherwise the runs drifted after the *agreement horizon* (the last step up to which every
  candidate agrees). Rounding differences (1e-7 in fp32) start small and grow as ReLU kinks,
  max-pool ties, batch norm and Adam amplify them, until two runs differ as two seeds do.
  So a candidate is DIFFERENT (likely a bug) when its loss already differs beyond rounding
  in the first steps (:data:`EARLY_STEPS`, :data:`ROUNDING_BOUNDS`), or when one of its
  final eval metrics falls outside where a further seed of the reference would land (a 99 %
  prediction interval from the K+1 seed runs); else it is EQUIVALENT. Without seed runs
  there is no spread to judge by: DRIFTED.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import attrs
import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from crosstrain.api import LaunchOptions, default_out_dir, make_job, run_job
from crosstrain.core.admission import admit
from crosstrain.core.convert import unstructure_plan
from crosstrain.core.errors import CrosstrainError, InputError, RunDirError
from crosstrain.core.plan import Plan
from crosstrain.core.runfolder import PLAN_FILE, read_run_plan
from crosstrain.core.strategy import DeviceChoice, PluginSelection
from crosstrain.launch.environments import detect_environment
from crosstrain.plugins.manager import CrosstrainPluginManager, get_backend
from crosstrain.plugins.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

COMPARE_FILE = "compare.json"
# compare reads each run's per-step losses from what this plugin writes
METRICS_PLUGIN = "metrics"

Role = Literal["reference", "candidate", "seed"]
ROLES: tuple[Role, ...] = ("reference", "candidate", "seed")
Kind = Literal["AGREE", "EQUIVALENT", "DRIFTED", "DIFFERENT"]

#: the steps whose loss difference must be rounding-sized for a drift to be rounding's:
#: step 1's loss is the initial weights' forward, step 2's the first after an update
EARLY_STEPS = 2
#: the largest relative step-loss difference rounding makes in those steps, by
#: ``train.precision``. fp32: measured up to 1.9e-7 (docs/running.md), a learning rate 10 %
#: off 1.4e-3 to 1.5e-2; the bound sits 50x above the one and 100x below the other. fp64:
#: not measured; its rounding is 5e8x finer than fp32's, the bound only 1e5x. bf16 (measured
#: 4e-4 to 7e-4) and fp16 (unit roundoff 5e-4) round as much as such a bug: no early check
#: (None), the seed spread alone judges.
ROUNDING_BOUNDS: dict[str, float | None] = {"fp64": 1e-10, "fp32": 1e-5, "bf16": None, "fp16": None}
#: how sure a DIFFERENT must be: a candidate that drifts as far as another seed would is
#: called DIFFERENT with at most this probability (for normally spread metrics)
SEED_CONFIDENCE = 0.99
#: the final metrics judged against the seed spread, as (label, summary section, key)
SPREAD_METRICS = (("eval loss", "eval", "loss"), ("eval accuracy", "eval", "accuracy"))
#: what is judged where a plan has no eval set (``data.eval_fraction = 0``)
NO_EVAL_SPREAD_METRICS = (("final train loss", "train", "loss"),)
#: the widest a table may be printed into a pipe or a log, unwrapped
UNWRAPPED_WIDTH = 400
#: how many steps after the horizon the table shows the difference at (log-spaced)
GROWTH_POINTS = 4


# --------------------------------------------------------------------------- runs


@attrs.frozen
class ListedRun:
    """One run of a compare folder, as ``compare.json`` lists it."""

    backend: str
    folder: str
    role: Role
    seed: int


@attrs.frozen
class BackendRun:
    """A finished run: its summary and per-step losses. ``label`` names it in the table
    (default: its backend)."""

    backend: str
    summary: Mapping[str, Any]
    losses: np.ndarray
    seed: int = 0
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.backend


@attrs.frozen
class ComparedRuns:
    reference: BackendRun
    candidates: tuple[BackendRun, ...]
    seed_runs: tuple[BackendRun, ...] = ()


def read_step_losses(run_dir: Path) -> np.ndarray:
    """Per-optimizer-step losses of the last run in ``run_dir``, in step order (NaN where
    the metrics plugin wrote null: a non-finite loss)."""
    records = read_metrics(run_dir)
    losses = [record["loss"] for record in records if "loss" in record and "eval" not in record]
    return np.array([np.nan if loss is None else loss for loss in losses], dtype=np.float64)


def read_backend_run(folder: Path, label: str = "") -> BackendRun:
    """A finished run from its folder: summary.json, metrics.jsonl and the plan's seed."""
    for name in (SUMMARY_FILE, METRICS_FILE, PLAN_FILE):
        if not (folder / name).is_file():
            raise RunDirError(f"{folder}: has no {name}; give the output folder of a finished crosstrain run")
    summary = json.loads((folder / SUMMARY_FILE).read_text(encoding="utf-8"))
    seed = read_run_plan(folder).seed
    return BackendRun(str(summary["backend"]), summary, read_step_losses(folder), seed, label)


# --------------------------------------------------------------------------- one candidate


@attrs.frozen
class Comparison:
    """How a candidate run differs from the reference, step by step and at the end."""

    reference: BackendRun
    candidate: BackendRun
    #: |candidate - reference| / |reference| per step (step s at index s-1); inf where one
    #: loss is not finite. Empty when the step counts differ.
    relative: np.ndarray
    tolerance: float
    eval_relative_loss_difference: float
    accuracy_difference: float

    @property
    def same_steps(self) -> bool:
        return len(self.reference.losses) == len(self.candidate.losses)

    @property
    def steps(self) -> int:
        return len(self.relative)

    @property
    def horizon(self) -> int:
        """The last step up to which every step's loss is within the tolerance (0: none)."""
        beyond = np.flatnonzero(self.relative > self.tolerance)
        return int(beyond[0]) if beyond.size else self.steps

    @property
    def leaves_at(self) -> int | None:
        """The first step beyond the tolerance; None when every step is within it."""
        return self.horizon + 1 if self.horizon < self.steps else None

    @property
    def max_relative_loss_difference(self) -> float:
        return float(self.relative.max()) if self.relative.size else float("inf")

    @property
    def worst_step(self) -> int:
        return int(np.argmax(self.relative)) + 1 if self.relative.size else 0

    def early_difference(self) -> tuple[int, float]:
        """The largest difference of the first :data:`EARLY_STEPS` steps, and its step."""
        early = self.relative[:EARLY_STEPS]
        if not early.size:
            return 0, 0.0
        return int(np.argmax(early)) + 1, float(early.max())

    def growth(self, points: int = GROWTH_POINTS) -> list[tuple[int, float]]:
        """The difference from the first step beyond the tolerance to the last, at
        ``points`` log-spaced steps: how fast it grows (orders of magnitude per decade)."""
        if self.leaves_at is None:
            return []
        steps = np.unique(np.geomspace(self.leaves_at, self.steps, points).round().astype(int))
        return [(int(step), float(self.relative[step - 1])) for step in steps]

    def agrees(self, accuracy_tolerance: float) -> bool:
        return (
            self.same_steps
            and self.leaves_at is None
            and self.eval_relative_loss_difference <= self.tolerance
            and self.accuracy_difference <= accuracy_tolerance
        )


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def step_relative_differences(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per step |candidate - reference| / |reference|; inf where either is not finite."""
    if reference.shape != candidate.shape:
        return np.zeros(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = np.abs(candidate - reference) / np.maximum(np.abs(reference), 1e-12)
    return np.where(np.isfinite(reference) & np.isfinite(candidate), relative, np.inf)


def compare_pair(reference: BackendRun, candidate: BackendRun, tolerance: float = 1e-4) -> Comparison:
    reference_eval, candidate_eval = reference.summary.get("eval", {}), candidate.summary.get("eval", {})
    eval_difference = (
        _relative(candidate_eval["loss"], reference_eval["loss"])
        if "loss" in reference_eval and "loss" in candidate_eval
        else 0.0
    )
    accuracy_difference = abs(candidate_eval.get("accuracy", 0.0) - reference_eval.get("accuracy", 0.0))
    relative = step_relative_differences(reference.losses, candidate.losses)
    return Comparison(reference, candidate, relative, tolerance, eval_difference, accuracy_difference)


# --------------------------------------------------------------------------- the seed spread


def metric_value(summary: Mapping[str, Any], section: str, key: str) -> float | None:
    value = (summary.get(section) or {}).get(key)
    return None if value is None else float(value)


@attrs.frozen
class MetricSpread:
    """One final metric over the reference backend's seed runs (the reference's own seed
    first): where a further seed lands."""

    label: str
    section: str
    key: str
    values: tuple[float, ...]
    #: the smallest difference the metric can show (accuracy: one eval example)
    resolution: float = 0.0

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        return self.high - self.low

    def interval(self, confidence: float = SEED_CONFIDENCE) -> tuple[float, float]:
        """The prediction interval of one more seed: mean +- t * s * sqrt(1 + 1/n), with
        Student's t at n - 1 degrees of freedom (n runs, sample deviation s), widened to
        the metric's resolution."""
        from scipy import stats  # type: ignore[import-untyped]  # scikit-learn's own dependency

        values = np.array(self.values)
        quantile = float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1))
        half = quantile * float(values.std(ddof=1)) * float(np.sqrt(1 + 1 / len(values)))
        half = max(half, self.resolution)
        return float(values.mean()) - half, float(values.mean()) + half

    def holds(self, value: float) -> bool:
        low, high = self.interval()
        return low <= value <= high


def seed_spreads(reference: BackendRun, seed_runs: Sequence[BackendRun]) -> list[MetricSpread]:
    """The spread of each of :data:`SPREAD_METRICS` the reference reports (of
    :data:`NO_EVAL_SPREAD_METRICS` where it reports none: no eval set), over the reference
    and its seed runs; none without seed runs."""
    if not seed_runs:
        return []
    runs = [reference, *seed_runs]
    has_eval = any(
        metric_value(reference.summary, section, key) is not None for _, section, key in SPREAD_METRICS
    )
    spreads = []
    for label, section, key in SPREAD_METRICS if has_eval else NO_EVAL_SPREAD_METRICS:
        values = [metric_value(run.summary, section, key) for run in runs]
        if any(value is None for value in values):
            continue
        count = metric_value(reference.summary, section, "count")
        resolution = 1.0 / count if key == "accuracy" and count else 0.0
        spreads.append(MetricSpread(label, section, key, tuple(cast(list[float], values)), resolution))
    return spreads


def seeds_text(seeds: Sequence[int]) -> str:
    """0..3 for consecutive seeds, else 0, 4, 9."""
    ordered = sorted(seeds)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return ", ".join(map(str, ordered))


# --------------------------------------------------------------------------- the verdict


@attrs.frozen
class Verdict:
    kind: Kind
    #: one per candidate: its own verdict
    per_candidate: Mapping[str, Kind]
    line: str

    @property
    def exit_code(self) -> int:
        return 1 if self.kind == "DIFFERENT" else 0


def rounding_bound(precision: str) -> float | None:
    if precision not in ROUNDING_BOUNDS:
        raise CrosstrainError(
            f"train.precision {precision!r}: compare knows no rounding bound for it "
            f"(known: {', '.join(ROUNDING_BOUNDS)})"
        )
    return ROUNDING_BOUNDS[precision]


def _early_reason(comparison: Comparison, precision: str) -> str | None:
    bound = rounding_bound(precision)
    step, difference = comparison.early_difference()
    if bound is None or difference <= bound:
        return None
    return (
        f"{comparison.candidate.name}'s step-{step} loss differs from {comparison.reference.name}'s "
        f"by {difference:.1e} (relative), beyond rounding ({bound:g} in {precision}) so soon after the start"
    )


def _spread_text(comparison: Comparison, spread: MetricSpread, seeds: str) -> str:
    """The candidate's metric against the reference's and the seeds': the numbers a user
    checks an EQUIVALENT or a DIFFERENT by."""
    value = cast(float, metric_value(comparison.candidate.summary, spread.section, spread.key))
    reference = spread.values[0]
    low, high = spread.interval()
    where = "another seed lands in" if spread.holds(value) else "outside where another seed lands,"
    return (
        f"{comparison.candidate.name}'s {spread.label} {value:.4f} differs from "
        f"{comparison.reference.name}'s {reference:.4f} by {abs(value - reference):.4f}; "
        f"seeds {seeds} spread {spread.low:.4f}..{spread.high:.4f} ({spread.spread:.4f}), "
        f"{where} {low:.4f}..{high:.4f} ({SEED_CONFIDENCE:.0%})"
    )


def judge_candidate(
    comparison: Comparison,
    spreads: Sequence[MetricSpread],
    seeds: str,
    precision: str,
    accuracy_tolerance: float,
) -> tuple[Kind, list[str]]:
    """One candidate's verdict and the reasons (DIFFERENT) or the numbers (EQUIVALENT)."""
    name, reference = comparison.candidate.name, comparison.reference.name
    if not comparison.same_steps:
        steps = (len(comparison.candidate.losses), len(comparison.reference.losses))
        return "DIFFERENT", [f"{name} ran {steps[0]} steps, {reference} {steps[1]}"]
    if comparison.agrees(accuracy_tolerance):
        return "AGREE", []
    early = _early_reason(comparison, precision)
    if early is not None:
        return "DIFFERENT", [early]
    if not spreads:
        return "DRIFTED", []
    candidate = comparison.candidate.summary
    values = [metric_value(candidate, spread.section, spread.key) for spread in spreads]
    missing = [
        f"{name} reports no {spread.label}"
        for spread, value in zip(spreads, values, strict=True)
        if value is None
    ]
    if missing:
        return "DIFFERENT", missing
    outside = [
        _spread_text(comparison, spread, seeds)
        for spread, value in zip(spreads, values, strict=True)
        if not spread.holds(cast(float, value))
    ]
    if outside:
        return "DIFFERENT", outside
    return "EQUIVALENT", [_spread_text(comparison, spread, seeds) for spread in spreads]


def _drift_text(comparisons: Sequence[Comparison]) -> str:
    """Where the first candidate to leave the tolerance leaves it, and how far it gets."""
    leaving = [c for c in comparisons if c.leaves_at is not None]
    if not leaving:  # every step agrees, an eval metric does not
        first = comparisons[0]
        return (
            f"every step within {first.tolerance:g}, but {first.candidate.name}'s eval loss differs "
            f"by {first.eval_relative_loss_difference:.1e}, its eval accuracy by "
            f"{first.accuracy_difference:.4f}"
        )
    first = min(leaving, key=lambda c: c.horizon)
    return (
        f"{first.candidate.name} leaves {first.tolerance:g} at step {first.leaves_at}, "
        f"{first.max_relative_loss_difference:.1e} by step {first.worst_step}"
    )


def _within_text(tolerance: float, horizon: int) -> str:
    if horizon == 0:
        return f"beyond {tolerance:g} from step 1"
    return f"every step within {tolerance:g} up to step {horizon}"


def judge(
    comparisons: Sequence[Comparison],
    spreads: Sequence[MetricSpread],
    seeds: Sequence[int],
    precision: str,
    accuracy_tolerance: float,
) -> Verdict:
    """The verdict of every candidate against the reference, as one line."""
    seed_label = seeds_text(seeds)
    judged = {
        c.candidate.name: judge_candidate(c, spreads, seed_label, precision, accuracy_tolerance)
        for c in comparisons
    }
    kinds = {name: kind for name, (kind, _) in judged.items()}
    horizon = min(c.horizon for c in comparisons)
    tolerance = comparisons[0].tolerance
    if "DIFFERENT" in kinds.values():
        reasons = [reason for kind, found in judged.values() if kind == "DIFFERENT" for reason in found]
        return Verdict("DIFFERENT", kinds, "verdict: DIFFERENT (likely a bug): " + "; ".join(reasons))
    if "DRIFTED" in kinds.values():
        line = (
            f"verdict: DRIFTED {'after step ' + str(horizon) if horizon else 'from step 1'} "
            f"({_drift_text(comparisons)}); "
            f"no seed spread to judge it by: --seeds 3 tells EQUIVALENT from DIFFERENT"
        )
        return Verdict("DRIFTED", kinds, line)
    if "EQUIVALENT" in kinds.values():
        numbers = [text for kind, found in judged.values() if kind == "EQUIVALENT" for text in found]
        line = (
            f"verdict: EQUIVALENT: {_within_text(tolerance, horizon)} ({_drift_text(comparisons)}), "
            f"then within the seed spread: " + "; ".join(numbers)
        )
        return Verdict("EQUIVALENT", kinds, line)
    steps = comparisons[0].steps
    line = (
        f"verdict: AGREE: every step's loss within {tolerance:g} (relative) for all {steps} steps, "
        f"eval loss within {tolerance:g}, eval accuracy within {accuracy_tolerance:g}"
    )
    return Verdict("AGREE", kinds, line)


# --------------------------------------------------------------------------- running the plan


@attrs.frozen
class CompareLaunch:
    """How ``crosstrain compare PLAN`` launches each run (the run command's options)."""

    replicas: int | None = 1
    workers: int | None = None
    device: DeviceChoice = "auto"
    plugins: PluginSelection = PluginSelection()
    timeout_seconds: float = 300.0


def plan_runs(backends: Sequence[str], seed: int, seeds: int) -> list[ListedRun]:
    """The runs of a compare: each backend (the first the reference) into a folder of its
    name (name-index where one backend runs twice: a determinism check must not share, and
    append to, one folder), then the reference backend at seeds seed+1..seed+K."""
    if len(backends) < 2:
        raise CrosstrainError("compare needs at least two backends, e.g. --backends torch,tf")
    if seeds < 0:
        raise InputError(f"--seeds {seeds}: must be 0 (off) or more")
    listed = [
        ListedRun(
            backend,
            backend if backends.count(backend) == 1 else f"{backend}-{index}",
            "reference" if index == 0 else "candidate",
            seed,
        )
        for index, backend in enumerate(backends)
    ]
    for offset in range(1, seeds + 1):
        listed.append(ListedRun(backends[0], f"{backends[0]}-seed{seed + offset}", "seed", seed + offset))
    return listed


def run_backends(
    plan: Plan,
    backends: Sequence[str],
    manager: CrosstrainPluginManager,
    out_root: Path,
    launch: CompareLaunch = CompareLaunch(),
    seeds: int = 0,
    tolerance: float = 1e-4,
) -> ComparedRuns:
    """Run the plan once per backend, each into ``out_root/FOLDER``, and ``seeds`` more
    times on the reference backend; every run is admitted before the first starts."""
    if METRICS_PLUGIN in launch.plugins.disabled:
        raise InputError(
            f"compare reads each run's per-step losses from {METRICS_FILE}, which the "
            f"{METRICS_PLUGIN!r} plugin writes: drop -p no:{METRICS_PLUGIN}"
        )
    listed = plan_runs(backends, plan.seed, seeds)
    rounding_bound(plan.train.precision)  # known before anything runs
    cluster = detect_environment()
    jobs = []
    for run in listed:
        options = LaunchOptions(
            backend=run.backend,
            replicas=launch.replicas,
            workers=launch.workers,
            device=launch.device,
            out=out_root / run.folder,
            plugins=launch.plugins,
            timeout_seconds=launch.timeout_seconds,
        )
        job = make_job(attrs.evolve(plan, seed=run.seed), options, cluster)
        admit(job, get_backend(manager, run.backend)(), cluster)
        jobs.append(job)
    write_compare_file(out_root, plan.name, listed, tolerance)
    finished = []
    for run, job in zip(listed, jobs, strict=True):
        summary = run_job(job, manager)
        finished.append(
            BackendRun(run.backend, summary, read_step_losses(Path(job.out_dir)), run.seed, run.folder)
        )
    return _sorted_runs(listed, finished)


def compare_plan(
    plan: Plan,
    backends: str,
    out: str | None,
    manager: CrosstrainPluginManager,
    launch: CompareLaunch = CompareLaunch(),
    seeds: int = 0,
    tolerance: float = 1e-4,
) -> tuple[ComparedRuns, Path]:
    """``crosstrain compare PLAN``: the comma-separated ``backends`` (and the seeds) run
    into ``out`` (default: a new folder under runs/); the runs and the compare folder."""
    out_root = Path(out) if out else default_out_dir(plan, "compare", launch.replicas or 1)
    names = [name.strip() for name in backends.split(",") if name.strip()]
    return run_backends(plan, names, manager, out_root, launch, seeds, tolerance), out_root


def _sorted_runs(listed: Sequence[ListedRun], runs: Sequence[BackendRun]) -> ComparedRuns:
    by_role: dict[Role, list[BackendRun]] = {role: [] for role in ROLES}
    for entry, run in zip(listed, runs, strict=True):
        by_role[entry.role].append(run)
    return ComparedRuns(by_role["reference"][0], tuple(by_role["candidate"]), tuple(by_role["seed"]))


# --------------------------------------------------------------------------- compare.json


def write_compare_file(out_root: Path, plan_name: str, listed: Sequence[ListedRun], tolerance: float) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    runs = [attrs.asdict(run) for run in listed]
    text = json.dumps({"plan": plan_name, "tolerance": tolerance, "runs": runs}, indent=2) + "\n"
    (out_root / COMPARE_FILE).write_text(text, encoding="utf-8")


def read_compare_file(folder: Path) -> list[ListedRun] | None:
    """The runs a compare folder lists, the reference first; None when ``folder`` is not
    one. An entry without a role (an older compare.json) is the reference when first,
    else a candidate."""
    path = folder / COMPARE_FILE
    if not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["runs"]
        listed = []
        for index, entry in enumerate(entries):
            role = entry.get("role", "reference" if index == 0 else "candidate")
            if role not in ROLES:
                raise ValueError(f"runs[{index}].role {role!r} is none of {', '.join(ROLES)}")
            listed.append(
                ListedRun(str(entry["backend"]), str(entry["folder"]), role, int(entry.get("seed", 0)))
            )
        return listed
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"{path}: not a compare file ({type(error).__name__}: {error})") from None


def compare_file_tolerance(folder: Path) -> float | None:
    """The tolerance the compare folder was made with (for its plot), if it says."""
    path = folder / COMPARE_FILE
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("tolerance")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def compare_run_folders(folder: Path) -> list[Path] | None:
    """The run folders of a compare folder, the reference first; None when ``folder`` is
    not one."""
    listed = read_compare_file(folder)
    return None if listed is None else [folder / run.folder for run in listed]


def compare_roles(folder: Path) -> list[tuple[Path, Role]] | None:
    """The run folders of a compare folder with their roles; None when it is not one."""
    listed = read_compare_file(folder)
    return None if listed is None else [(folder / run.folder, run.role) for run in listed]


# --------------------------------------------------------------------------- existing runs


def is_run_or_compare_folder(path: Path) -> bool:
    return path.is_dir() and ((path / PLAN_FILE).is_file() or (path / COMPARE_FILE).is_file())


def not_a_run_folder(path: Path) -> InputError:
    return InputError(
        f"{path}: holds neither {PLAN_FILE} (a run folder) nor {COMPARE_FILE} (a compare folder)"
    )


def expand_run_folders(paths: Sequence[Path]) -> list[Path]:
    """Run folders in order; a compare folder stands for its runs, its reference first."""
    folders: list[Path] = []
    for path in paths:
        if not is_run_or_compare_folder(path):
            raise not_a_run_folder(path)
        members = None if (path / PLAN_FILE).is_file() else compare_run_folders(path)
        folders.extend(members if members is not None else [path])
    return folders


def plan_difference(reference: Any, other: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first field (a dotted path) where two unstructured plans differ, with both values."""
    if isinstance(reference, dict) and isinstance(other, dict):
        for key in [*reference, *(key for key in other if key not in reference)]:
            found = plan_difference(reference.get(key), other.get(key), f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(reference, list) and isinstance(other, list) and len(reference) == len(other):
        for index, (first, second) in enumerate(zip(reference, other, strict=True)):
            found = plan_difference(first, second, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if reference == other else (path, reference, other)


#: plan fields in which runs of one comparison may differ: the seed makes a seed run, the
#: output section only says where and how often a run writes
FREE_PLAN_FIELDS = ("seed", "output")


def _comparable(plan: Plan) -> dict[str, Any]:
    raw = unstructure_plan(plan)
    for field in FREE_PLAN_FIELDS:
        raw.pop(field, None)
    return raw


def load_run_folders(paths: Sequence[Path]) -> ComparedRuns:
    """Finished runs to compare, the first the reference: a run of the reference's plan is
    a candidate, one whose plan differs only in its seed is a seed run, any other is
    refused naming the first field its plan differs in."""
    folders = expand_run_folders(paths)
    if len(folders) < 2:
        given = ", ".join(map(str, paths))
        raise InputError(f"compare needs at least two runs; {given} hold {len(folders)}")
    plans = [read_run_plan(folder) for folder in folders]
    reference_plan = _comparable(plans[0])
    roles: list[Role] = ["reference"]
    for folder, plan in zip(folders[1:], plans[1:], strict=True):
        difference = plan_difference(reference_plan, _comparable(plan))
        if difference is not None:
            field, expected, found = difference
            raise InputError(
                f"{folder}: its plan differs from {folders[0]}'s in {field} ({found!r} there, "
                f"{expected!r} in the reference): compare takes runs of one plan, seeds aside"
            )
        roles.append("candidate" if plan.seed == plans[0].seed else "seed")
    if "candidate" not in roles:
        raise InputError(
            f"compare needs a run of {folders[0]}'s plan and seed besides it; the others differ in "
            f"their seeds only (seed runs)"
        )
    runs = [read_backend_run(folder) for folder in folders]
    labels = _labels(runs, folders, roles)
    listed = [
        ListedRun(run.backend, str(folder), role, run.seed)
        for run, folder, role in zip(runs, folders, roles, strict=True)
    ]
    labelled = [attrs.evolve(run, label=label) for run, label in zip(runs, labels, strict=True)]
    return _sorted_runs(listed, labelled)


def _labels(runs: Sequence[BackendRun], folders: Sequence[Path], roles: Sequence[Role]) -> list[str]:
    """How each run is named in the table and the verdict: its backend where no other
    compared run (seed runs aside) has that backend, else its folder's name, else its path."""
    shown = [run.backend for run, role in zip(runs, roles, strict=True) if role != "seed"]
    names = [folder.name for folder, role in zip(folders, roles, strict=True) if role != "seed"]
    labels = []
    for run, folder in zip(runs, folders, strict=True):
        if shown.count(run.backend) <= 1:
            labels.append(run.backend)
        else:
            labels.append(folder.name if names.count(folder.name) == 1 else str(folder))
    return labels


# --------------------------------------------------------------------------- the report


def comparisons_of(runs: ComparedRuns, tolerance: float) -> list[Comparison]:
    return [compare_pair(runs.reference, candidate, tolerance) for candidate in runs.candidates]


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
    precision = str(runs.reference.summary.get("precision", "fp32"))
    verdict = judge(comparisons, spreads, seeds, precision, accuracy_tolerance)
    shown = [runs.reference, *runs.candidates]
    table = Table(title=f"compare: {', '.join(run.name for run in shown)}")
    table.add_column("")
    for run in shown:
        table.add_column(run.name, justify="right")
    if spreads:
        table.add_column(f"{runs.reference.name} seeds {seeds_text(seeds)}", justify="right")
    _add_run_rows(table, shown, spreads)
    _add_comparison_rows(table, comparisons, precision, verdict, bool(spreads))
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
    table: Table, comparisons: Sequence[Comparison], precision: str, verdict: Verdict, seeded: bool
) -> None:
    bound = rounding_bound(precision)
    early_label = f"steps 1-{EARLY_STEPS} rel. diff" + (f" (rounding: <={bound:g})" if bound else "")
    rows: list[tuple[str, Callable[[Comparison], str]]] = [
        (f"agreement horizon ({comparisons[0].tolerance:g})", _horizon_cell),
        ("then (step: rel. diff)", _growth_cell),
        ("max rel. step-loss diff", lambda c: f"{c.max_relative_loss_difference:.2e} (step {c.worst_step})"),
        (early_label, lambda c: f"{c.early_difference()[1]:.1e}"),
        ("eval loss rel. diff", lambda c: f"{c.eval_relative_loss_difference:.2e}"),
        ("verdict", lambda c: verdict.per_candidate[c.candidate.name]),
    ]
    for label, cell in rows:
        table.add_row(label, "-", *(cell(c) for c in comparisons), *(["-"] if seeded else []))
