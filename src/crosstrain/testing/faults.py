"""A fault-injecting plugin for conformance tests (``-p crosstrain.testing.faults``).

At step ``CROSSTRAIN_TEST_FAIL_STEP`` (default 3), on rank ``CROSSTRAIN_TEST_FAIL_RANK``
(default: the last process), the worker does what ``CROSSTRAIN_TEST_FAULT`` says:
"raise" (the default) a RuntimeError, "kill" itself with SIGKILL, or "hang" (sleep an
hour: only the launcher's heartbeat deadline can end it). ``CROSSTRAIN_TEST_FAIL_ONCE=PATH``
faults only while PATH does not exist (creating it), so a restarted worker group runs
through. The hook runs when the step's metrics are logged: pass
``--set output.log_every_steps=1`` to hit the step exactly.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

FAIL_STEP = 3
HANG_SECONDS = 3600.0


def _raise(step: int) -> None:
    raise RuntimeError(f"injected failure at step {step}")


def _kill(step: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hang(step: int) -> None:
    time.sleep(HANG_SECONDS)


FAULTS = {"raise": _raise, "kill": _kill, "hang": _hang}


@hookimpl(trylast=True)  # after the metrics log has written the step
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
    FAULTS[os.environ.get("CROSSTRAIN_TEST_FAULT", "raise")](step)
