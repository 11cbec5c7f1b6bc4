"""A plugin for benchmarks/profile_host.py (`-p op_profile_plugin`, with benchmarks/ on the
path): torch.profiler from the read of step 2 x ``log_every_steps`` to the read of step 4 x
that, its op table (self CPU time, calls) written to ``op-profile.txt`` in the run folder.
Steps are read in chunks, so how many steps ran meanwhile is the calls of
``Optimizer.step``, not the difference of the two numbers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from crosstrain import RunContext, hookimpl

_PROFILE: dict[str, Any] = {}


@hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    every = context.plan.output.log_every_steps
    if step == 2 * every and "profiler" not in _PROFILE:
        _PROFILE["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        _PROFILE["profiler"].__enter__()
    elif step == 4 * every and "profiler" in _PROFILE and "done" not in _PROFILE:
        _PROFILE["done"] = True
        _PROFILE["profiler"].__exit__(None, None, None)
        table = _PROFILE["profiler"].key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        Path(context.out_dir, "op-profile.txt").write_text(f"{table}\n")
