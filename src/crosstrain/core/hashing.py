"""The counter-based hash that dropout, augmentation and the text source draw from: a pure
function of integers (seed, step or epoch, row, position), so every framework, world size
and resumed run computes the same bits with no random-number state to carry."""

from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
#: odd multipliers below 2**31 (a product with a 32-bit value fits in int64)
MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)


def mix(value: np.ndarray) -> np.ndarray:
    """A 32-bit avalanche mix (xor-shift-multiply) on int64 arrays of 32-bit values."""
    value = value ^ (value >> 16)
    value = (value * MULTIPLIERS[0]) & MASK32
    value = value ^ (value >> 15)
    value = (value * MULTIPLIERS[1]) & MASK32
    return value ^ (value >> 16)
