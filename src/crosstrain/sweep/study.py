"""The sweep folder's study and settings: what the sweep and its trials' plugin share.

``study.sqlite`` is Optuna's RDB storage of the study (TPE sampler, median pruner);
``sweep.json`` what the sweep searches, so that running the same command again continues
the same search.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

STUDY_FILE, TRIALS_DIR, SETTINGS_FILE, LOCK_FILE = "study.sqlite", "trials", "sweep.json", ".sweep.lock"
LOG_FILE = "trial.log"  # each trial process's output, in its run folder
STUDY_NAME = "crosstrain"
#: the summary's "stopped" reason of a trial the pruner stopped starts so
PRUNED = "pruned by the sweep's median pruner"
#: the median pruner compares a trial with the others once this many have finished
PRUNER_STARTUP_TRIALS = 3
#: seconds a trial's process waits for the study's sqlite file when another writes
SQLITE_TIMEOUT = 60


@attrs.frozen
class SweepSettings:
    """What a sweep searches; kept in ``sweep.json``, so continuing asks the same."""

    plan: str
    objective: str
    searches: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    #: the launch flags every trial runs with (--backend, --nproc, --device, ...)
    run_flags: tuple[str, ...] = ()
    #: -p values, given to every trial's crosstrain
    plugin_args: tuple[str, ...] = ()


def storage_url(sweep_dir: Path) -> str:
    return f"sqlite:///{(sweep_dir / STUDY_FILE).resolve()}"


def open_study(sweep_dir: Path, direction: str | None = None, seed: int | None = None) -> Any:
    """The sweep's Optuna study (created with ``direction`` where it is new): TPE sampler,
    median pruner."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(
        storage_url(sweep_dir), engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT}}
    )
    return optuna.create_study(
        storage=storage,
        study_name=STUDY_NAME,
        direction=direction,
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP_TRIALS),
        load_if_exists=True,
    )


def read_settings(sweep_dir: Path) -> SweepSettings | None:
    path = sweep_dir / SETTINGS_FILE
    if not path.is_file():
        return None
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    listed = {
        name: tuple(raw.get(name, ())) for name in ("searches", "overrides", "run_flags", "plugin_args")
    }
    return SweepSettings(str(raw["plan"]), str(raw["objective"]), **listed)
