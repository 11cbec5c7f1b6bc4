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

from crosstrain.core.hashing import MASK32, MULTIPLIERS, mix

#: the hash's pieces are part of dropout's contract: a backend writes them in its own ops
__all__ = ["KEEP_BITS", "MASK32", "MULTIPLIERS", "keep_mask", "mix", "threshold"]

KEEP_BITS = 24


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
