"""The worker's side of the launcher: run the training, leave a result or an error file.

A worker started by :func:`crosstrain.launch.run_workers` finds its folder and rank in its
environment (:data:`LAUNCH_DIR`, :data:`LAUNCH_RANK`) and calls :func:`serve` with the
function that trains; every failure, even SystemExit, reaches the launcher once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.launch.reports import error_path, error_report, result_path, write_atomically

LAUNCH_DIR = "CROSSTRAIN_LAUNCH_DIR"
LAUNCH_RANK = "CROSSTRAIN_LAUNCH_RANK"


def worker_folder() -> Path:
    return Path(os.environ[LAUNCH_DIR])


def worker_rank() -> int:
    return int(os.environ[LAUNCH_RANK])


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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip a framework's teardown, which can wait on peers that are gone
