"""The worker's side of the launcher: run the training, leave a result or an error file.

A worker started by :func:`crosstrain.launch.run_workers` finds its folder and rank in its
environment (:data:`LAUNCH_DIR`, :data:`LAUNCH_RANK`) and calls :func:`serve` with the
function that trains; every failure, even SystemExit, reaches the launcher once. A worker
of a restarted group (:data:`RESTART_COUNT` > 0) runs
``crosstrain.core.run.worker.attempt_job(job, restart_count())``, which resumes.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.launch.outcomes import error_path, error_report, result_path, write_atomically
from crosstrain.launch.process import exit_now

LAUNCH_DIR = "CROSSTRAIN_LAUNCH_DIR"
LAUNCH_RANK = "CROSSTRAIN_LAUNCH_RANK"
#: how many times the launcher has restarted this worker's group (torch's agent says
#: TORCHELASTIC_RESTART_COUNT)
RESTART_COUNT = "CROSSTRAIN_RESTART_COUNT"


def worker_folder() -> Path:
    return Path(os.environ[LAUNCH_DIR])


def worker_rank() -> int:
    return int(os.environ[LAUNCH_RANK])


def restart_count() -> int:
    """0 in a first start; n in the group's n-th restart (the worker then resumes)."""
    return int(os.environ.get(RESTART_COUNT, "0"))


def serve(train: Callable[[], dict[str, Any]]) -> None:
    """Run ``train`` and report; after a failure the process ends here. SIGTERM (the
    launcher stopping this worker) ends it at once, quietly: the launcher reports why."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    folder, rank = worker_folder(), worker_rank()
    try:
        summary = train()
        write_atomically(result_path(folder, rank), summary)
    except BaseException as error:  # every failure, even SystemExit, reaches the launcher once
        write_atomically(error_path(folder, rank), error_report(error, traceback.format_exc(), time.time()))
        exit_now(1)  # skip a framework's teardown, which can wait on peers that are gone
    exit_now(0)  # the launcher waits for this exit: a framework's teardown only delays it
