"""A fault-injecting plugin for conformance tests (``-p crosstrain.testing.faults``): the
last process raises at step 3 (``CROSSTRAIN_TEST_FAIL_RANK`` picks another rank)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from crosstrain.core.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

FAIL_STEP = 3


@hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    rank = int(os.environ.get("CROSSTRAIN_TEST_FAIL_RANK", context.world.process_count - 1))
    if step == FAIL_STEP and context.world.rank == rank:
        raise RuntimeError(f"injected failure at step {FAIL_STEP}")
