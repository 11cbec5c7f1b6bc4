"""A test plugin (``-p jaxtest_faults``): at step 3 the worker raises or hangs, as
``CROSSTRAIN_JAX_TEST_FAULT`` says ("raise" or "hang")."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import crosstrain
from crosstrain.core.context import RunContext


@crosstrain.hookimpl
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    fault = os.environ.get("CROSSTRAIN_JAX_TEST_FAULT", "")
    if step == 3 and fault == "raise":
        raise RuntimeError("injected failure at step 3")
    if step == 3 and fault == "hang":
        time.sleep(600)  # the launcher's heartbeat timeout must end this, not the sleep
