"""Dropout masks every backend computes identically: a counter-based hash, no RNG state.

Whether element ``position`` of global row ``row`` is kept by dropout layer ``layer`` at
optimizer step ``step`` depends on those integers and the plan's seed only, so the mask is
the same in every framework, at every world size and after a resume. Each backend writes
:func:`keep_mask` in its own integer ops (int64 tensors holding 32-bit values, multipliers
below 2**31 so that no product overflows); this numpy version is the reference they are
tested against.

- ``row``: the row's position in the step's global batch (micro-batches included), which
  is the same whichever replica holds the row;
- ``position``: the element's index within the row's flattened features;
- ``layer``: the dropout node's index in the model graph;
- a row's element is kept when the top 24 bits of the hash are >= ``threshold(rate)``,
  an integer comparison, then scaled by ``1 / (1 - rate)`` as in every framework.
"""

from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
#: odd multipliers below 2**31 (a product with a 32-bit value fits in int64)
MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)
KEEP_BITS = 24


def mix(value: np.ndarray) -> np.ndarray:
    """A 32-bit avalanche mix (xor-shift-multiply) on int64 arrays of 32-bit values."""
    value = value ^ (value >> 16)
    value = (value * MULTIPLIERS[0]) & MASK32
    value = value ^ (value >> 15)
    value = (value * MULTIPLIERS[1]) & MASK32
    return value ^ (value >> 16)


def threshold(rate: float) -> int:
    """Elements whose 24-bit hash is below this are dropped."""
    return round(rate * (1 << KEEP_BITS))


def keep_mask(seed: int, step: int, layer: int, rows: np.ndarray, features: int, rate: float) -> np.ndarray:
    """bool [len(rows), features]: which elements dropout keeps."""
    state = mix(np.asarray(seed & MASK32, np.int64))
    state = mix(state ^ np.int64(step & MASK32))
    state = mix(state ^ np.int64(layer & MASK32))
    per_row = mix(state ^ (np.asarray(rows, np.int64)[:, None] & MASK32))
    hashed = mix(per_row ^ np.arange(features, dtype=np.int64)[None, :])
    return np.asarray((hashed >> (32 - KEEP_BITS)) >= threshold(rate))
