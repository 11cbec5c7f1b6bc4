"""What runs inside every worker process (or the one process of an in-process backend).

Core sits below the plugin manager (:mod:`crosstrain.plugins.manager`) and never imports
it: the job carries the function that loads a process's plugins (``Job.load_hooks``),
set where the job is made (``crosstrain.api.make_job``, on the top floor). That function
travels with the pickled job, so a worker that a launcher started (torch's elastic agent,
crosstrain's shared launcher, a third party's) loads exactly the plugins the CLI chose,
and no module below the top floor names the manager.
"""

from __future__ import annotations

from typing import Any

import attrs
import pluggy

from crosstrain.core.data.sources.images import close_decode_pool
from crosstrain.core.run.context import RunContext
from crosstrain.core.run.job import Job
from crosstrain.core.run.loop import fit, report_exception
from crosstrain.core.run.strategy import DistributedStrategy


def attempt_job(job: Job, restart_count: int) -> Job:
    """The job a (re)started worker runs: a launcher that restarted its group after a
    failure (``restart_count`` > 0) resumes from the run folder's last checkpoint, or from
    the start when there is none yet. Launchers call this with their own restart count.
    The checkpoint chosen at launch (``resume_from``) is dropped: the group may have written
    newer ones since."""
    return (
        attrs.evolve(job, launch=attrs.evolve(job.launch, resume=True), resume_from=None)
        if restart_count > 0
        else job
    )


def load_hooks(job: Job) -> pluggy.HookRelay:
    """The hook relay of the job's plugins, loaded in this process."""
    if job.load_hooks is None:
        # a job made by hand, not by make_job: running it without plugins would silently
        # write no metrics, so say what is missing instead
        raise ValueError(
            "job.load_hooks is not set: make the job with crosstrain.api.make_job, or give "
            "Job(load_hooks=crosstrain.plugins.manager.hook_relay)"
        )
    return job.load_hooks(job.launch.plugins)


def run_worker(strategy: DistributedStrategy, job: Job) -> dict[str, Any]:
    """Load the job's plugins in this process and run fit(). A failure is reported through
    ``crosstrain_exception`` exactly once, then propagates to the launcher."""
    hook = load_hooks(job)
    try:
        return fit(strategy, job, hook)
    except BaseException as error:
        # fit() reports errors with its full context; this catches those raised before it had one
        early = RunContext(
            job=job, world=strategy.world, total_steps=0, steps_per_epoch=0, train_rows=0, eval_rows=0
        )
        report_exception(hook, early, error)
        raise
    finally:
        close_decode_pool()
