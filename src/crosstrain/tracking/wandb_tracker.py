"""Built-in plugin ``wandb``: ``crosstrain run PLAN --wandb [PROJECT]``.

The project is PROJECT, else the plan's name; the W&B run is named by the run folder and
kept in it (``wandb/``). It runs online where credentials are configured
(``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc), offline otherwise (``wandb sync
RUN_FOLDER/wandb/offline-run-*`` uploads it later); ``WANDB_MODE`` overrides both. Needs
``crosstrain[wandb]``; what it logs is :mod:`crosstrain.tracking.base`'s.
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crosstrain.core.run.context import RunContext
from crosstrain.tracking.base import TrackerOption, TrackerPlugin

NAME = "wandb"
HOST = "api.wandb.ai"


def has_credentials() -> bool:
    """An API key in the environment, or ``wandb login``'s entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(HOST) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def mode() -> Any:  # W&B's own Literal; WANDB_MODE is W&B's to check
    return os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline")


class WandbRun:
    """One W&B run, quiet: no console capture, no system statistics, no prints."""

    def __init__(self, context: RunContext, given: str, run_id: str | None) -> None:
        import wandb

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True)
        self._run = wandb.init(
            project=given or context.plan.name,
            name=context.out_dir.name,
            dir=str(context.out_dir),
            id=run_id,
            resume="allow" if run_id is not None else None,
            mode=mode(),
            settings=settings,
        )
        self.run_id: str = self._run.id

    def log_params(self, params: Mapping[str, str]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, steps: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        for step, values in steps:
            self._run.log(dict(values), step=step)

    def log_artifacts(self, files: Sequence[Path], summary: Mapping[str, Any]) -> None:
        import wandb

        artifact = wandb.Artifact(f"run-{self.run_id}", type="crosstrain-run")
        for path in files:
            artifact.add_file(str(path))
        self._run.log_artifact(artifact)
        self._run.summary.update({name: value for name, value in summary.items() if name != "ranks"})

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


OPTION = TrackerOption(
    module="wandb",
    extra="wandb",
    metavar="PROJECT",
    help="log the run to W&B (default project: the plan's name; offline unless credentials are configured)",
)
# The entry point names this instance ("crosstrain.tracking.wandb_tracker:plugin").
plugin = TrackerPlugin(NAME, "Weights & Biases", OPTION, WandbRun)
