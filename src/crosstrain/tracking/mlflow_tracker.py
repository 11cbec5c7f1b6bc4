"""Built-in plugin ``mlflow``: ``crosstrain run PLAN --mlflow [TRACKING_URI]``.

The store is TRACKING_URI, else ``MLFLOW_TRACKING_URI`` when set, else a local one beside
the run folder: ``mlflow.db`` (sqlite) and ``mlartifacts/`` in the run folder's parent, so
the runs of one parent folder (a sweep's trials, a team's ``runs/``) share one store, which
``mlflow ui --backend-store-uri sqlite:///PARENT/mlflow.db`` shows. The experiment is the
plan's name; the MLflow run is named by the run folder. Needs ``crosstrain[mlflow]``
(MLflow's client and what its sqlite store needs); what it logs is
:mod:`crosstrain.tracking.base`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crosstrain.core.run.context import RunContext
from crosstrain.tracking.base import TrackerOption, TrackerPlugin

NAME = "mlflow"
STORE_FILE, ARTIFACTS_DIR = "mlflow.db", "mlartifacts"
#: MLflow's limits on one log_batch call
PARAMS_PER_BATCH, METRICS_PER_BATCH = 100, 1000


def store_of(given: str, run_dir: Path) -> tuple[str, str | None]:
    """The tracking URI and, for the local default store, the artifact location of a new
    experiment (None: the store's own default)."""
    uri = given or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri, None
    parent = run_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{parent / STORE_FILE}", (parent / ARTIFACTS_DIR).as_uri()


class MlflowRun:
    """One MLflow run through MLflow's own client (no global "active run")."""

    def __init__(self, context: RunContext, given: str, run_id: str | None) -> None:
        from mlflow.tracking import MlflowClient

        uri, artifacts = store_of(given, context.out_dir)
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self._experiment(context.plan.name, artifacts)
            tags = {"crosstrain.run_folder": str(context.out_dir), "crosstrain.backend": context.backend}
            run_id = self._client.create_run(experiment, run_name=context.out_dir.name, tags=tags).info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id

    def _experiment(self, name: str, artifacts: str | None) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(name, artifact_location=artifacts))
        except MlflowException:  # another run (a sweep's parallel trial) created it first
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(name, value) for name, value in params.items()]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[start : start + PARAMS_PER_BATCH])

    def log_metrics(self, steps: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(name, value, now, step) for step, values in steps for name, value in values.items()]
        for start in range(0, len(items), METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=items[start : start + METRICS_PER_BATCH])

    def log_artifacts(self, files: Sequence[Path], summary: Mapping[str, Any]) -> None:
        for path in files:
            self._client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


OPTION = TrackerOption(
    module="mlflow",
    extra="mlflow",
    metavar="TRACKING_URI",
    help="log the run to MLflow (default store: MLFLOW_TRACKING_URI, else sqlite mlflow.db "
    "beside the run folder)",
)
# The entry point names this instance ("crosstrain.tracking.mlflow_tracker:plugin").
plugin = TrackerPlugin(NAME, "MLflow", OPTION, MlflowRun)
