"""The run folder: never silently reused, never shared by two runs at once.

A folder that holds a run (any of :data:`RUN_OUTPUTS`) is an error unless the run resumes
it (``--resume``: it must hold a complete checkpoint) or replaces it (``--overwrite``, which
removes those outputs and nothing else: a plan file kept beside them stays).
While a run is in progress its launcher holds an exclusive lock on
``.crosstrain.lock`` in the folder; a second run into the same folder is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from crosstrain.core.checkpoint import last_checkpoint
from crosstrain.core.errors import RunFolderError
from crosstrain.core.plan import Plan, validate_plan

LOCK_FILE = ".crosstrain.lock"
#: the plan as run (overrides applied, data paths absolute): evaluate, predict and export
#: read the model and its data from it
PLAN_FILE = "plan.json"
#: what a run writes into its folder (built-in plugins included)
RUN_OUTPUTS = (
    PLAN_FILE,
    "metrics.jsonl",
    "summary.json",
    "model.safetensors",
    "checkpoints",
    "tensorboard",
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
        raise RunFolderError(
            f"--resume: {out_dir} has no complete checkpoint (set output.checkpoint_every_steps); "
            f"--overwrite starts it again"
        )


def _check_contents(out_dir: Path, resume: bool, overwrite: bool) -> None:
    existing = [out_dir / name for name in RUN_OUTPUTS if (out_dir / name).exists()]
    if resume:
        check_request(out_dir, resume, overwrite)  # again, under the lock
        return
    if existing and not overwrite:
        raise RunFolderError(
            f"run folder {out_dir} already holds a run; --resume continues it, --overwrite replaces it"
        )
    for child in existing:
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


def write_run_plan(out_dir: Path, plan: Plan) -> Path:
    """The plan as run, as JSON, replaced atomically (a resumed run may change its output)."""
    from crosstrain.core.convert import unstructure_plan

    path = Path(out_dir) / PLAN_FILE
    temporary = path.with_name(path.name + ".tmp")
    source = str(Path(plan.source).resolve()) if plan.source else None
    document = {"source": source, "plan": unstructure_plan(plan)}
    temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return path


def run_plan_source(run_dir: Path) -> Path | None:
    """The plan file the run was started from (its folder holds a native model's module)."""
    document = json.loads((Path(run_dir) / PLAN_FILE).read_text(encoding="utf-8"))
    source = document.get("source")
    return Path(source) if isinstance(source, str) else None


def read_run_plan(run_dir: Path) -> Plan:
    """The plan a run folder was trained with; a missing or unreadable file names itself."""
    from crosstrain.core.convert import structure_plan

    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise RunFolderError(f"{path}: no such file (a run folder written by crosstrain run holds it)")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        raw = document["plan"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise RunFolderError(f"{path}: not a crosstrain plan file ({error})") from None
    plan = structure_plan(raw, source=str(path))
    validate_plan(plan)
    return plan
