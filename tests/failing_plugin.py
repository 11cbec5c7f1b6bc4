"""A test plugin (loaded with `-p tests.failing_plugin`): rank 1 raises at step 3.

Set CROSSTRAIN_TEST_FAIL_RANK to pick another rank."""

from __future__ import annotations

import os
from collections.abc import Mapping

import crosstrain
from crosstrain.core.context import RunContext


@crosstrain.hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    if step == 3 and context.world.rank == int(os.environ.get("CROSSTRAIN_TEST_FAIL_RANK", "1")):
        raise RuntimeError("injected failure at step 3")
