"""The runs of a comparison on disk: ``compare.json`` (each run's folder, backend, seed and
role), reading a finished run's summary and per-step losses, and gathering existing run
folders whose plans differ only in :data:`FREE_PLAN_FIELDS`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from crosstrain.compare.difference import BackendRun, ComparedRuns
from crosstrain.compare.verdict import rounding_probe_plan
from crosstrain.core.convert import unstructure_plan
from crosstrain.core.errors import InputError, RunDirError
from crosstrain.core.plan import Plan
from crosstrain.core.runfolder import PLAN_FILE, read_run_plan
from crosstrain.plugins.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

COMPARE_FILE = "compare.json"

#: ``rounding``: the reference's first steps again at another world size (the rounding probe)
Role = Literal["reference", "candidate", "seed", "rounding"]
ROLES: tuple[Role, ...] = ("reference", "candidate", "seed", "rounding")


@attrs.frozen
class ListedRun:
    """One run of a compare folder, as ``compare.json`` lists it."""

    backend: str
    folder: str
    role: Role
    seed: int


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


def sorted_runs(listed: Sequence[ListedRun], runs: Sequence[BackendRun]) -> ComparedRuns:
    """The finished ``runs`` grouped by the roles ``listed`` gives them, in the same order."""
    by_role: dict[Role, list[BackendRun]] = {role: [] for role in ROLES}
    for entry, run in zip(listed, runs, strict=True):
        by_role[entry.role].append(run)
    probes = by_role["rounding"]
    return ComparedRuns(
        by_role["reference"][0],
        tuple(by_role["candidate"]),
        tuple(by_role["seed"]),
        probes[0] if probes else None,
    )


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


def _is_probe(reference: BackendRun, reference_plan: Plan, run: BackendRun, plan: Plan) -> bool:
    """Whether ``run`` is the reference's rounding probe: its plan's first steps at
    another world size."""
    probe = rounding_probe_plan(reference_plan)
    return (
        probe is not None
        and plan.seed == reference_plan.seed
        and _comparable(probe) == _comparable(plan)
        and run.summary.get("world_size") != reference.summary.get("world_size")
    )


def _role(reference: tuple[Path, Plan, BackendRun], folder: Path, plan: Plan, run: BackendRun) -> Role:
    """A run of the reference's plan is a candidate, one whose plan differs only in its
    seed a seed run, the reference's rounding probe the probe; any other is refused
    naming the first field its plan differs in."""
    reference_folder, reference_plan, reference_run = reference
    difference = plan_difference(_comparable(reference_plan), _comparable(plan))
    if difference is None:
        return "candidate" if plan.seed == reference_plan.seed else "seed"
    if _is_probe(reference_run, reference_plan, run, plan):
        return "rounding"
    field, wanted, found = difference
    raise InputError(
        f"{folder}: its plan differs from {reference_folder}'s in {field} ({found!r} there, "
        f"{wanted!r} in the reference): compare takes runs of one plan, seeds aside"
    )


def load_run_folders(paths: Sequence[Path]) -> ComparedRuns:
    """Finished runs to compare, the first the reference: a run of the reference's plan is
    a candidate, one whose plan differs only in its seed is a seed run, the reference's
    rounding probe is the probe, any other is refused naming the first field its plan
    differs in."""
    folders = expand_run_folders(paths)
    if len(folders) < 2:
        given = ", ".join(map(str, paths))
        raise InputError(f"compare needs at least two runs; {given} hold {len(folders)}")
    plans = [read_run_plan(folder) for folder in folders]
    runs = [read_backend_run(folder) for folder in folders]
    reference = (folders[0], plans[0], runs[0])
    roles: list[Role] = ["reference"]
    for folder, plan, run in zip(folders[1:], plans[1:], runs[1:], strict=True):
        roles.append(_role(reference, folder, plan, run))
    if "candidate" not in roles:
        raise InputError(
            f"compare needs a run of {folders[0]}'s plan and seed besides it; the others are seed "
            f"runs or its rounding probe"
        )
    if roles.count("rounding") > 1:
        raise InputError(f"compare takes one rounding probe of {folders[0]}; {roles.count('rounding')} given")
    labels = _labels(runs, folders, roles)
    listed = [
        ListedRun(run.backend, str(folder), role, run.seed)
        for run, folder, role in zip(runs, folders, roles, strict=True)
    ]
    labelled = [attrs.evolve(run, label=label) for run, label in zip(runs, labels, strict=True)]
    return sorted_runs(listed, labelled)


def _labels(runs: Sequence[BackendRun], folders: Sequence[Path], roles: Sequence[Role]) -> list[str]:
    """How each run is named in the table and the verdict: its backend where no other
    compared run (seed runs and the probe aside) has that backend, else its folder's name, else its path."""
    shown = [run.backend for run, role in zip(runs, roles, strict=True) if role in ("reference", "candidate")]
    names = [
        folder.name for folder, role in zip(folders, roles, strict=True) if role in ("reference", "candidate")
    ]
    labels = []
    for run, folder in zip(runs, folders, strict=True):
        if shown.count(run.backend) <= 1:
            labels.append(run.backend)
        else:
            labels.append(folder.name if names.count(folder.name) == 1 else str(folder))
    return labels
