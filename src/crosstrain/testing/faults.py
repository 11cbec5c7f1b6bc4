"""A fault-injecting plugin for conformance tests (``-p crosstrain.testing.faults``): the
last process raises at step 3. ``CROSSTRAIN_TEST_FAIL_RANK`` picks another rank,
``CROSSTRAIN_TEST_FAIL_STEP`` another step, and ``CROSSTRAIN_TEST_FAIL_ONCE=PATH`` fails only
while PATH does not exist (creating it), so a restarted worker group runs through."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from crosstrain.core.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

FAIL_STEP = 3


@hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    rank = int(os.environ.get("CROSSTRAIN_TEST_FAIL_RANK", context.world.process_count - 1))
    fail_step = int(os.environ.get("CROSSTRAIN_TEST_FAIL_STEP", FAIL_STEP))
    if step != fail_step or context.world.rank != rank:
        return
    once = os.environ.get("CROSSTRAIN_TEST_FAIL_ONCE")
    if once:
        if Path(once).exists():
            return
        Path(once).touch()
    raise RuntimeError(f"injected failure at step {fail_step}")
