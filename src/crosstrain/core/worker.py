"""What runs inside every worker process (or the one process of an in-process backend)."""

from __future__ import annotations

from typing import Any

import attrs

from crosstrain.core.context import RunContext
from crosstrain.core.loop import fit, report_exception
from crosstrain.core.strategy import DistributedStrategy, Job


def attempt_job(job: Job, restart_count: int) -> Job:
    """The job a (re)started worker runs: a launcher that restarted its group after a
    failure (``restart_count`` > 0) resumes from the run folder's last checkpoint, or from
    the start when there is none yet. Launchers call this with their own restart count."""
    return attrs.evolve(job, resume=True) if restart_count > 0 else job


def run_worker(strategy: DistributedStrategy, job: Job) -> dict[str, Any]:
    """Load the job's plugins in this process and run fit(). A failure is reported through
    ``crosstrain_exception`` exactly once, then propagates to the launcher."""
    from crosstrain.plugins.manager import make_plugin_manager

    manager = make_plugin_manager(job.plugins)
    try:
        return fit(strategy, job, manager.hook)
    except BaseException as error:
        # fit() reports errors with its full context; this catches those raised before it had one
        early = RunContext(
            job=job, world=strategy.world, total_steps=0, steps_per_epoch=0, train_rows=0, eval_rows=0
        )
        report_exception(manager.hook, early, error)
        raise
