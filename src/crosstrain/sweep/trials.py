"""The sweep's trials: asked of Optuna's study, each run by ``crosstrain run`` in a process
of its own, and told back; ``--parallel K`` runs K at once and shares the machine.

The study (``study.sqlite``: Optuna's RDB storage) holds every trial and its state, so the
same command again continues it: ``--trials N`` is the study's total, a trial a killed
sweep left running is resumed from its checkpoint (or run again from its start, in the
same folder and under the same number), and a finished trial is never run again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from crosstrain.api import prepare_plan
from crosstrain.core.errors import InputError
from crosstrain.core.run.checkpoint import last_checkpoint
from crosstrain.launch.gpus import count_gpus
from crosstrain.plugins.metrics import SUMMARY_FILE
from crosstrain.sweep.space import Objective, Search, objective, override, parse_search, unique_fields
from crosstrain.sweep.study import (
    LOCK_FILE,
    LOG_FILE,
    PRUNED,
    SETTINGS_FILE,
    TRIALS_DIR,
    SweepSettings,
    open_study,
    read_settings,
)


def check_settings(settings: SweepSettings) -> tuple[list[Search], Objective]:
    """The searches and the objective, each space's values tried on the plan: a wrong field
    or value is refused here, naming it, before the first trial starts."""
    searches = [parse_search(text) for text in settings.searches]
    if not searches:
        raise InputError("sweep: give at least one --search FIELD=SPACE")
    unique_fields(searches)
    chosen = objective(settings.objective)
    for search in searches:
        for value in search.examples():
            prepare_plan(settings.plan, [*settings.overrides, override(search.field, value)])
    return searches, chosen


@contextlib.contextmanager
def holding(sweep_dir: Path) -> Iterator[None]:
    """The sweep folder's lock: one sweep at a time (a trial left running is then stale)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with (sweep_dir / LOCK_FILE).open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"sweep folder {sweep_dir} is in use by another sweep") from None
        yield


def keep_settings(sweep_dir: Path, settings: SweepSettings) -> None:
    """Write sweep.json, or refuse to continue a sweep that searched something else."""
    earlier = read_settings(sweep_dir)
    if earlier is None:
        (sweep_dir / SETTINGS_FILE).write_text(json.dumps(attrs.asdict(settings), indent=2) + "\n")
        return
    for name in ("plan", "objective", "searches", "overrides"):
        if getattr(earlier, name) != getattr(settings, name):
            raise InputError(
                f"sweep folder {sweep_dir} holds a sweep with another {name} "
                f"({getattr(earlier, name)!r}); continue it as it was, or give another --out"
            )


@attrs.frozen
class Machine:
    """How the trials share this machine: each slot's GPUs, else its CPU threads."""

    slots: int
    gpus: int
    cores: int

    def environment(self, slot: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)  # one GPU per trial
        else:
            env.setdefault("OMP_NUM_THREADS", str(max(1, self.cores // self.slots)))
        return env


def this_machine(slots: int, device: str | None) -> Machine:
    """Its GPUs (none asked of a framework; none when the trials run on the CPU) and cores."""
    return Machine(slots, 0 if device == "cpu" else count_gpus(), os.cpu_count() or 1)


@attrs.frozen
class TrialRun:
    """One trial to run: its number, its plan values, and whether it continues a folder."""

    number: int
    params: dict[str, Any]
    again: bool = False


def trial_command(settings: SweepSettings, sweep_dir: Path, trial: TrialRun) -> list[str]:
    """``crosstrain run`` of one trial: the plan with the trial's values, into its folder;
    a trial run again resumes from its checkpoint, or starts over in the same folder."""
    folder = sweep_dir / TRIALS_DIR / str(trial.number)
    head = [sys.executable, "-m", "crosstrain.cli", *(f"-p{value}" for value in settings.plugin_args), "run"]
    tail = ["--sweep-trial", f"{sweep_dir.resolve()}:{trial.number}"]
    if trial.again and last_checkpoint(folder) is not None:
        return [*head, "--out", str(folder), "--resume", *tail]
    values = [override(field, value) for field, value in trial.params.items()]
    sets = [item for text in [*settings.overrides, *values] for item in ("--set", text)]
    again = ["--overwrite"] if trial.again else []
    return [*head, settings.plan, "--out", str(folder), *settings.run_flags, *sets, *again, *tail]


def shown(params: dict[str, Any]) -> str:
    """A trial's values, floats to 4 digits."""
    return ", ".join(
        f"{field}={value:.4g}" if isinstance(value, float) else f"{field}={value}"
        for field, value in params.items()
    )


def trial_outcome(folder: Path, exit_code: int, chosen: Objective) -> tuple[str, float | None]:
    """ "complete" and the objective, "pruned", or "fail"."""
    path = folder / SUMMARY_FILE
    if exit_code != 0 or not path.is_file():
        return "fail", None
    summary = json.loads(path.read_text(encoding="utf-8"))
    reason = (summary.get("stopped") or {}).get("reason") or ""
    if reason.startswith(PRUNED):
        return "pruned", None
    value = chosen.value(summary)
    if value is None or not math.isfinite(value):
        return "fail", None
    return "complete", value


def run_trials(
    settings: SweepSettings,
    sweep_dir: Path,
    total: int,
    parallel: int,
    device: str | None,
    say: Callable[[str], None],
) -> Any:
    """Bring the study to ``total`` trials, ``parallel`` at a time; return the study."""
    import optuna

    searches, chosen = check_settings(settings)
    with holding(sweep_dir):
        keep_settings(sweep_dir, settings)
        seed = prepare_plan(settings.plan, settings.overrides).seed
        study = open_study(sweep_dir, chosen.direction, seed)
        stale = [
            TrialRun(trial.number, trial.params, again=True)
            for trial in study.trials
            if trial.state == optuna.trial.TrialState.RUNNING
        ]
        new = max(0, total - len(study.trials))
        if stale:
            say(f"sweep: continuing trial {', '.join(str(t.number) for t in stale)} (left running)")
        distributions = {search.field: search.distribution() for search in searches}
        asking = threading.Lock()
        machine = this_machine(parallel, device)
        slots: queue.Queue[int] = queue.Queue()
        for slot in range(parallel):
            slots.put(slot)

        def next_trial(index: int) -> TrialRun:
            if index < len(stale):
                return stale[index]
            with asking:  # TPE asks with every result told so far
                asked = study.ask(distributions)
            return TrialRun(asked.number, asked.params)

        def run_one(index: int) -> None:
            slot = slots.get()
            try:
                trial = next_trial(index)
                _run_trial(study, settings, sweep_dir, trial, chosen, machine.environment(slot), say)
            finally:
                slots.put(slot)

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for future in [pool.submit(run_one, index) for index in range(len(stale) + new)]:
                future.result()
    return study


def _run_trial(
    study: Any,
    settings: SweepSettings,
    sweep_dir: Path,
    trial: TrialRun,
    chosen: Objective,
    env: dict[str, str],
    say: Callable[[str], None],
) -> None:
    import optuna

    folder = sweep_dir / TRIALS_DIR / str(trial.number)
    folder.mkdir(parents=True, exist_ok=True)
    say(f"trial {trial.number}: {shown(trial.params)}")
    with (folder / LOG_FILE).open("a", encoding="utf-8") as log:
        done = subprocess.run(
            trial_command(settings, sweep_dir, trial),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    state, value = trial_outcome(folder, done.returncode, chosen)
    if state == "complete":
        study.tell(trial.number, value)
        say(f"trial {trial.number}: {settings.objective} {value:.6g}")
    elif state == "pruned":
        study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
        say(f"trial {trial.number}: pruned")
    else:
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        say(f"trial {trial.number}: failed (exit {done.returncode}; its output: {folder / LOG_FILE})")
