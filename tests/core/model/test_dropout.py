"""The counter-based dropout hash: deterministic, keyed by every counter, at its rate."""

from __future__ import annotations

import numpy as np
import pytest

from crosstrain.core.model.dropout import keep_mask


def test_the_mask_depends_on_every_counter_and_nothing_else() -> None:
    rows = np.arange(64)
    base = keep_mask(0, 5, 2, rows, 300, 0.5)
    assert np.array_equal(base, keep_mask(0, 5, 2, rows, 300, 0.5))
    for changed in (
        keep_mask(1, 5, 2, rows, 300, 0.5),
        keep_mask(0, 6, 2, rows, 300, 0.5),
        keep_mask(0, 5, 3, rows, 300, 0.5),
    ):
        assert 0.4 < np.mean(changed != base) < 0.6  # independent-looking, not shifted copies
    # a row's mask depends on its global position only: world N slices see world 1's rows
    assert np.array_equal(keep_mask(0, 5, 2, rows[32:], 300, 0.5), base[32:])


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_the_kept_fraction_is_one_minus_the_rate(rate: float) -> None:
    kept = keep_mask(7, 0, 0, np.arange(512), 512, rate)
    assert abs(kept.mean() - (1 - rate)) < 0.01
    assert keep_mask(7, 0, 0, np.arange(4), 8, 0.0).all()
