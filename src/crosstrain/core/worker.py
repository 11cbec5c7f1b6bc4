"""What runs inside every worker process (or the one process of an in-process backend)."""

from __future__ import annotations

from typing import Any

from crosstrain.core.context import RunContext
from crosstrain.core.loop import fit
from crosstrain.core.strategy import DistributedStrategy, Job


def run_worker(strategy: DistributedStrategy, job: Job) -> dict[str, Any]:
    """Load the job's plugins in this process, run fit(), and report a failure exactly once
    through ``crosstrain_exception`` before letting it propagate to the launcher."""
    from crosstrain.plugins.manager import make_plugin_manager

    manager = make_plugin_manager(job.plugins)
    try:
        return fit(strategy, job, manager.hook)
    except BaseException as error:
        context = RunContext(
            job=job, world=strategy.world, total_steps=0, steps_per_epoch=0, train_rows=0, eval_rows=0
        )
        manager.hook.crosstrain_exception(context=context, rank=strategy.world.process_index, error=error)
        raise
