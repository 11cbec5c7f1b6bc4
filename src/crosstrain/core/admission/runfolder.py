"""The run folder: never silently reused, never shared by two runs at once.

A folder that holds a run (any of :data:`RUN_OUTPUTS`) is an error unless the run resumes
it (``--resume``: it must hold a complete checkpoint) or replaces it (``--overwrite``, which
removes those outputs and nothing else: a plan file kept beside them stays).
While a run is in progress its launcher holds an exclusive lock on
``.crosstrain.lock`` in the folder; a second run into the same folder is refused.

A resumed run continues the plan it was started with: ``plan.json`` (overrides included),
changed only where :func:`continued_plan` allows (the output section and the run's length),
on the layout of its last launch (``launch.json``) where no flag overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import typing
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import attrs

from crosstrain.core.data.sources.images import CLASSES_FILE, read_image_index
from crosstrain.core.data.sources.table import STATISTICS_FILE, TableStatistics, write_statistics
from crosstrain.core.errors import ERROR_LOG, InputError, RunFolderError
from crosstrain.core.run.checkpoint import MODEL_FILE, last_checkpoint
from crosstrain.core.run.job import DeviceChoice, Layout
from crosstrain.core.run.loading import table_datasets
from crosstrain.core.spec.plan import Plan, validate_plan

LOCK_FILE = ".crosstrain.lock"
#: the plan as run (overrides applied, data paths absolute): evaluate, predict and export
#: read the model and its data from it
PLAN_FILE = "plan.json"
#: the layout of the run's last launch (backend, nproc, workers, nnodes, device): what a
#: bare ``--resume`` continues on
LAUNCH_FILE = "launch.json"
#: what a run writes into its folder (built-in plugins included)
RUN_OUTPUTS = (
    PLAN_FILE,
    LAUNCH_FILE,
    STATISTICS_FILE,
    "metrics.jsonl",
    "summary.json",
    CLASSES_FILE,
    "model.safetensors",
    "checkpoints",
    "tensorboard",
    ERROR_LOG,
)


@contextlib.contextmanager
def open_run_folder(out_dir: Path, resume: bool = False, overwrite: bool = False) -> Iterator[Path]:
    """Create (or check, or clear) the run folder and hold its lock for the block."""
    out_dir = Path(out_dir)
    check_request(out_dir, resume, overwrite)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir):
        _check_contents(out_dir, resume, overwrite)
        yield out_dir


def check_request(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """What can be refused before the folder is touched (the admission step asks too):
    the flags together, and a resumed folder that does not exist or holds no checkpoint."""
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite exclude each other")
    if resume and not out_dir.is_dir():
        raise RunFolderError(f"--resume: no run folder {out_dir}")
    if resume and last_checkpoint(out_dir) is None:
        if (out_dir / MODEL_FILE).is_file():  # a finished run that wrote no checkpoints
            raise RunFolderError(
                f"--resume: {out_dir} has no checkpoint to continue (its run did not set "
                f"output.checkpoint_every_steps); --init-from {out_dir} starts a new run from its weights"
            )
        raise RunFolderError(
            f"--resume: {out_dir} has no complete checkpoint (set output.checkpoint_every_steps); "
            f"--overwrite starts it again"
        )


def check_unclaimed(out_dir: Path, overwrite: bool) -> list[Path]:
    """A new run's folder holds no run, or ``overwrite`` replaces it; the outputs to replace."""
    existing = [out_dir / name for name in RUN_OUTPUTS if (out_dir / name).exists()]
    if existing and not overwrite:
        raise RunFolderError(
            f"run folder {out_dir} already holds a run; --resume continues it, --overwrite replaces it"
        )
    return existing


def _check_contents(out_dir: Path, resume: bool, overwrite: bool) -> None:
    if resume:
        check_request(out_dir, resume, overwrite)  # again, under the lock
        return
    for child in check_unclaimed(out_dir, overwrite):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """An exclusive, non-blocking lock: the kernel releases it when this process dies, so a
    killed run never leaves the folder locked."""
    path = out_dir / LOCK_FILE
    handle: IO[str] = path.open("a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise RunFolderError(f"run folder {out_dir} is in use by another run (pid {holder})") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


def write_run_plan(
    out_dir: Path,
    plan: Plan,
    init_from: str | None = None,
    table_statistics: Mapping[str, Any] | None = None,
) -> Path:
    """The plan as run, as JSON, replaced atomically (a resumed run may change its output
    and its length); ``init_from``: the weights a new run started from (``--init-from``);
    ``table_statistics``: a table's statistics as the admission computed them (None: they
    are computed here)."""
    from crosstrain.core.spec.plan_dicts import unstructure_plan

    path = Path(out_dir) / PLAN_FILE
    temporary = path.with_name(path.name + ".tmp")
    source = str(Path(plan.source).resolve()) if plan.source else None
    document: dict[str, Any] = {"source": source, "plan": unstructure_plan(plan)}
    if init_from is None and path.is_file():  # a resumed run keeps what it started from
        init_from = _read_document(path).get("init_from")
    if init_from is not None:
        document["init_from"] = init_from
    temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    write_data_statistics(Path(out_dir), plan, table_statistics)
    if plan.data.source == "images":
        write_classes(Path(out_dir), plan)
    return path


def write_launch_record(out_dir: Path, layout: Layout) -> Path:
    """The layout this launch runs on (:data:`LAUNCH_FILE`), replaced atomically: a bare
    ``--resume`` continues on it, and a resumed run's header says whether it does."""
    path = Path(out_dir) / LAUNCH_FILE
    document = {
        "backend": layout.backend,
        "nproc": layout.replicas,
        "workers": layout.workers,
        "nnodes": layout.nnodes,
        "device": layout.device,
    }
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return path


def read_launch_record(run_dir: Path) -> Layout | None:
    """The layout a run folder recorded at its last launch; None for a folder written
    before runs recorded it. A file that does not read as one names itself."""
    path = Path(run_dir) / LAUNCH_FILE
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        layout = Layout(
            backend=str(document["backend"]),
            replicas=_count(document["nproc"]),
            workers=None if document["workers"] is None else _count(document["workers"]),
            nnodes=_count(document["nnodes"]),
            device=document["device"],
        )
    except KeyError as error:
        raise RunFolderError(f"{path}: not a crosstrain launch record (no {error.args[0]!r})") from None
    except (OSError, ValueError, TypeError) as error:
        raise RunFolderError(f"{path}: not a crosstrain launch record ({error})") from None
    if layout.device not in typing.get_args(DeviceChoice):
        raise RunFolderError(f"{path}: not a crosstrain launch record (device {layout.device!r})")
    return layout


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{value!r} is not a count")
    return value


def write_data_statistics(out_dir: Path, plan: Plan, computed: Mapping[str, Any] | None = None) -> None:
    """A table's statistics (category codes, mean and std: :data:`STATISTICS_FILE`), computed
    from its training rows when the run starts (``computed``: already, by the admission); a
    resumed run keeps those it started with."""
    if plan.data.source == "table" and not (out_dir / STATISTICS_FILE).is_file():
        statistics = TableStatistics.from_json(computed) if computed else table_datasets(plan)[1]
        write_statistics(out_dir, statistics)


def write_classes(out_dir: Path, plan: Plan) -> Path:
    """An image run's class names (``classes.json``, label i the i-th), read from its
    training files (sorted by name), so evaluate and predict name the same classes."""
    assert plan.data.path is not None
    classes = read_image_index(plan.data.path, "data.path", plan.source).classes
    path = Path(out_dir) / CLASSES_FILE
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(list(classes), indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return path


def read_classes(run_dir: Path) -> tuple[str, ...] | None:
    """An image run's class names (None: the run keeps none)."""
    path = Path(run_dir) / CLASSES_FILE
    if not path.is_file():
        return None
    return tuple(str(name) for name in json.loads(path.read_text(encoding="utf-8")))


def run_plan_source(run_dir: Path) -> Path | None:
    """The plan file the run was started from (its folder holds a native model's module)."""
    document = json.loads((Path(run_dir) / PLAN_FILE).read_text(encoding="utf-8"))
    source = document.get("source")
    return Path(source) if isinstance(source, str) else None


def read_run_plan(run_dir: Path) -> Plan:
    """The plan a run folder was trained with; a missing or unreadable file names itself."""
    from crosstrain.core.spec.plan_dicts import structure_plan

    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise RunFolderError(f"{path}: no such file (a run folder written by crosstrain run holds it)")
    try:
        raw = _read_document(path)["plan"]
    except (KeyError, TypeError) as error:
        raise RunFolderError(f"{path}: not a crosstrain plan file ({error})") from None
    plan = structure_plan(raw, source=str(path))
    validate_plan(plan)
    return plan


def _read_document(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunFolderError(f"{path}: not a crosstrain plan file ({error})") from None
    if not isinstance(document, dict):
        raise RunFolderError(f"{path}: not a crosstrain plan file")
    return document


# --------------------------------------------------------------------------- a continued run

#: the fields of a plan that may change when its run continues (``--resume``): where and how
#: often it writes, how long it runs (the run continues to the new end), and how its
#: replicas shard it (checkpoints are neutral whatever the mode)
MAY_CHANGE = ("output", "train.epochs", "train.max_steps", "train.shard")
_ABSENT = object()


class _Entries(int):
    """A list of tables' length, compared as one field of the list."""

    def __str__(self) -> str:
        return f"{int(self)} entries" if self != 1 else "1 entry"


@attrs.frozen
class PlanChange:
    """One field that differs between the run's plan and the one asked for now."""

    field: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.field}: {_shown(self.before)} in the run, {_shown(self.after)} now"


def continued_plan(
    run_dir: Path, requested: Plan, stated: Collection[str] | None
) -> tuple[Plan, list[PlanChange]]:
    """The plan a resumed run continues with: the run's own (``plan.json``: its overrides
    included), with the changes ``requested`` states, and those changes.

    ``stated``: the fields the user gave now (a plan file's keys, ``--set`` fields; a field
    covers everything under it); None: every field (a Python plan). A field left unstated
    keeps the run's value, so a run started with ``--set`` overrides continues with them.
    A stated field that differs from the run and is not in :data:`MAY_CHANGE` is refused,
    every such field named with both values, before anything starts."""
    from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan

    run = read_run_plan(run_dir)
    before, after = _leaves(unstructure_plan(run)), _leaves(unstructure_plan(requested))
    fields = [*before, *(field for field in after if field not in before)]
    changes = [
        PlanChange(field, before.get(field, _ABSENT), after.get(field, _ABSENT))
        for field in fields
        if _is_stated(field, stated) and before.get(field, _ABSENT) != after.get(field, _ABSENT)
    ]
    # a list that grew or shrank is one change, not one per entry beyond the shorter one
    resized = [change.field for change in changes if isinstance(change.before, _Entries)]
    changes = [change for change in changes if not change.field.startswith(tuple(f"{f}[" for f in resized))]
    refused = [change for change in changes if not _may_change(change.field)]
    if refused:
        raise InputError(
            f"--resume: {'; '.join(str(change) for change in refused)}; only the output section, "
            f"train.epochs, train.max_steps and train.shard may change when a run continues "
            f"({Path(run_dir) / PLAN_FILE} holds its plan: --resume without a plan file "
            f"continues it as it was)"
        )
    raw = unstructure_plan(run)
    for change in changes:
        section, _, key = change.field.partition(".")
        if change.after is _ABSENT:  # left out of plan.json at its default: the default
            raw[section].pop(key, None)
        else:
            raw[section][key] = change.after
    plan = structure_plan(raw, source=_continued_source(run_dir, requested))
    validate_plan(plan)
    return plan, changes


def _continued_source(run_dir: Path, requested: Plan) -> str:
    """The plan file a continued run names (a native model's module sits beside it)."""
    if requested.source is not None and Path(requested.source).is_file():
        return requested.source
    recorded = run_plan_source(run_dir)
    return str(recorded) if recorded is not None and recorded.is_file() else str(Path(run_dir) / PLAN_FILE)


def _may_change(field: str) -> bool:
    return any(field == allowed or field.startswith(allowed + ".") for allowed in MAY_CHANGE)


def _is_stated(field: str, stated: Collection[str] | None) -> bool:
    if stated is None:
        return True
    return any(field == given or field.startswith((given + ".", given + "[")) for given in stated)


def _leaves(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every value of an unstructured plan under its field path (``model.layers[0].units``);
    a list of plain values (a shape) is one value."""
    found: dict[str, Any] = {}
    for key, value in raw.items():
        _add_leaves(found, f"{prefix}{key}", value)
    return found


def _add_leaves(found: dict[str, Any], field: str, value: Any) -> None:
    if isinstance(value, Mapping):
        found.update(_leaves(value, field + "."))
    elif isinstance(value, list | tuple) and any(isinstance(item, Mapping) for item in value):
        found[field] = _Entries(len(value))
        for index, item in enumerate(value):
            _add_leaves(found, f"{field}[{index}]", item)
    elif isinstance(value, list | tuple):
        found[field] = [list(item) if isinstance(item, tuple) else item for item in value]
    else:
        found[field] = value


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)
