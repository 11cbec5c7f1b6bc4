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
from crosstrain.compare.verdict import probe_plan, without_evaluation
from crosstrain.core.admission.runfolder import PLAN_FILE, read_run_plan
from crosstrain.core.errors import InputError, RunDirError
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.plan_dicts import unstructure_plan
from crosstrain.plugins.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

COMPARE_FILE = "compare.json"

#: ``fp64``: a run's first steps again in fp64 (its fp64 probe: ``ListedRun.probes`` names it)
Role = Literal["reference", "candidate", "seed", "fp64"]
ROLES: tuple[Role, ...] = ("reference", "candidate", "seed", "fp64")


@attrs.frozen
class ListedRun:
    """One run of a compare folder, as ``compare.json`` lists it."""

    backend: str
    folder: str
    role: Role
    seed: int
    #: an fp64 probe's: the folder of the run it probes
    probes: str = ""


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
    """The finished ``runs`` grouped by the roles ``listed`` gives them, in the same order,
    each fp64 probe's losses given to the run it probes."""
    probes = {
        entry.probes: run.losses for entry, run in zip(listed, runs, strict=True) if entry.role == "fp64"
    }
    by_role: dict[Role, list[BackendRun]] = {role: [] for role in ROLES}
    for entry, run in zip(listed, runs, strict=True):
        by_role[entry.role].append(attrs.evolve(run, probe=probes.get(entry.folder)))
    return ComparedRuns(by_role["reference"][0], tuple(by_role["candidate"]), tuple(by_role["seed"]))


def write_compare_file(out_root: Path, plan_name: str, listed: Sequence[ListedRun], tolerance: float) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    # a probe names the run it probes; the other runs probe none
    runs = [
        {key: value for key, value in attrs.asdict(run).items() if key != "probes" or value} for run in listed
    ]
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
                ListedRun(
                    str(entry["backend"]),
                    str(entry["folder"]),
                    role,
                    int(entry.get("seed", 0)),
                    str(entry.get("probes", "")),
                )
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


def _role(reference: tuple[Path, Plan], folder: Path, plan: Plan) -> Role:
    """A run of the reference's plan is a candidate, one whose plan differs only in its
    seed a seed run, one of its first steps in fp64 an fp64 probe; any other is refused
    naming the first field its plan differs in."""
    reference_folder, reference_plan = reference
    difference = plan_difference(_comparable(reference_plan), _comparable(plan))
    if difference is None:
        return "candidate" if plan.seed == reference_plan.seed else "seed"
    probe = probe_plan(reference_plan)
    same_steps = probe is not None and _comparable(probe) == _comparable(without_evaluation(plan))
    if same_steps and plan.seed == reference_plan.seed:
        return "fp64"
    field, wanted, found = difference
    raise InputError(
        f"{folder}: its plan differs from {reference_folder}'s in {field} ({found!r} there, "
        f"{wanted!r} in the reference): compare takes runs of one plan, seeds aside"
    )


def _probed(folders: Sequence[Path], runs: Sequence[BackendRun], roles: Sequence[Role]) -> list[str]:
    """For each fp64 probe, the folder of the run it probes: the first compared run of its
    backend and world that has no probe yet ("" for the others)."""
    compared = [index for index, role in enumerate(roles) if role in ("reference", "candidate")]
    probed = [""] * len(folders)
    for index, role in enumerate(roles):
        if role != "fp64":
            continue
        layout = (runs[index].backend, runs[index].summary.get("world_size"))
        free = [
            other
            for other in compared
            if (runs[other].backend, runs[other].summary.get("world_size")) == layout
            and str(folders[other]) not in probed
        ]
        if not free:
            raise InputError(
                f"{folders[index]}: an fp64 probe of no {layout[0]} x{layout[1]} run given beside it "
                f"(or of one that has a probe already)"
            )
        probed[index] = str(folders[free[0]])
    return probed


def load_run_folders(paths: Sequence[Path]) -> ComparedRuns:
    """Finished runs to compare, the first the reference: a run of the reference's plan is
    a candidate, one whose plan differs only in its seed is a seed run, one of its first
    steps in fp64 the fp64 probe of the run of its backend and world, any other is refused
    naming the first field its plan differs in."""
    folders = expand_run_folders(paths)
    if len(folders) < 2:
        given = ", ".join(map(str, paths))
        raise InputError(f"compare needs at least two runs; {given} hold {len(folders)}")
    plans = [read_run_plan(folder) for folder in folders]
    roles: list[Role] = ["reference"]
    for folder, plan in zip(folders[1:], plans[1:], strict=True):
        roles.append(_role((folders[0], plans[0]), folder, plan))
    if "candidate" not in roles:
        raise InputError(
            f"compare needs a run of {folders[0]}'s plan and seed besides it; the others are seed "
            f"runs or fp64 probes"
        )
    runs = [read_backend_run(folder) for folder in folders]
    labels = _labels(runs, folders, roles)
    listed = [
        ListedRun(run.backend, str(folder), role, run.seed, probed)
        for run, folder, role, probed in zip(runs, folders, roles, _probed(folders, runs, roles), strict=True)
    ]
    labelled = [attrs.evolve(run, label=label) for run, label in zip(runs, labels, strict=True)]
    return sorted_runs(listed, labelled)


def _labels(runs: Sequence[BackendRun], folders: Sequence[Path], roles: Sequence[Role]) -> list[str]:
    """How each run is named in the table and the verdict: its backend where no other
    compared run (seed runs and fp64 probes aside) has that backend, else its folder's name, else its path."""
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
