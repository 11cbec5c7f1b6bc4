"""Built-in plugin ``sweep``: a sweep's trial reports each evaluation to the study, and
stops, as early stopping does (``context.request_stop``), when the median pruner says so.

``crosstrain sweep`` gives each trial ``--sweep-trial SWEEP_DIR:NUMBER`` (a hidden option:
the sweep's own business). Rank 0 reports; the ranks agree on the stop at the next read.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl
from crosstrain.sweep.space import OBJECTIVES, Objective
from crosstrain.sweep.study import PRUNED, open_study, read_settings

OPTION = "sweep_trial"


class TrialReporter:
    """This process's trial of the study, opened at the run's start (rank 0 only)."""

    def __init__(self) -> None:
        self._trial: Any = None
        self._objective: Objective | None = None

    def start(self, context: RunContext) -> None:
        self._trial = self._objective = None
        given = context.options.get(OPTION)
        if given is None or not context.world.is_main:
            return
        import optuna

        folder, _, number = str(given).rpartition(":")
        settings = read_settings(Path(folder))
        if settings is None:
            return
        study = open_study(Path(folder))
        trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, int(number))
        self._trial = optuna.trial.Trial(study, trial_id)
        self._objective = OBJECTIVES[settings.objective]

    def evaluation(self, context: RunContext, step: int, metrics: Mapping[str, float]) -> None:
        objective = self._objective
        if self._trial is None or objective is None or objective.section != "eval":
            return
        value = metrics.get(objective.name)
        if value is None:
            return
        self._trial.report(float(value), step)
        if self._trial.should_prune():
            context.request_stop(
                f"{PRUNED} at step {step} ({objective.section}_{objective.name} {value:.6g})"
            )


_reporter = TrialReporter()


@hookimpl
def crosstrain_addoption(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep-trial", dest=OPTION, default=None, help=argparse.SUPPRESS)


@hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    _reporter.start(context)


@hookimpl
def crosstrain_eval_end(context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
    _reporter.evaluation(context, step, metrics)
