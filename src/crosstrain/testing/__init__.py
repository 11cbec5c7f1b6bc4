"""What every backend must satisfy, importable by a third party's tests.

``crosstrain.testing`` holds the readers of a finished run and the comparisons with their
stated tolerances, so crosstrain's own suites and a third-party backend's (the jax example)
assert the same things the same way. It imports no framework and no test runner.
"""

from crosstrain.testing.runs import (
    EVAL_LOSS_RELATIVE_TOLERANCE,
    assert_same_eval,
    max_relative_difference,
    step_losses,
    summary,
)

__all__ = [
    "EVAL_LOSS_RELATIVE_TOLERANCE",
    "assert_same_eval",
    "max_relative_difference",
    "step_losses",
    "summary",
]
