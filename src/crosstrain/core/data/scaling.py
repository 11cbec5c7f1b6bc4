"""Inputs scaled as the plan asks (``data.scale``, ``data.mean``, ``data.std``).

The model sees ``(float32(raw) * scale - mean) / std``, mean and std per channel (the
last axis) or one value for all. The arrays keep their own dtype until a batch is read,
so raw uint8 images stay uint8 in memory and, on the built-in backends, until they reach
the device, placed there or copied each step (``Batch.stored_x``). Every backend computes
the same three float32 operations in this order: each is correctly rounded, so the result
is the same bits everywhere.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import numpy as np

from crosstrain.core.data.arrays import ArrayRows, StoredRows, Translated, Translation


@attrs.frozen
class InputScaling:
    """``x * scale``, then ``- mean``, then ``/ std``; an identity step is left out (it
    would change no bit, and costs a pass over the batch)."""

    scale: float = 1.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and not any(self.mean) and all(value == 1.0 for value in self.std)

    def steps(self) -> list[tuple[str, np.ndarray]]:
        """The operations as (``"mul"`` | ``"sub"`` | ``"div"``, float32 operand), in order;
        a backend applies them with its own ops."""
        steps: list[tuple[str, np.ndarray]] = []
        if self.scale != 1.0:
            steps.append(("mul", np.float32(self.scale) * np.ones(1, np.float32)))
        if any(self.mean):
            steps.append(("sub", np.asarray(self.mean, np.float32)))
        if self.std and any(value != 1.0 for value in self.std):
            steps.append(("div", np.asarray(self.std, np.float32)))
        return steps

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The numpy reference, on the host."""
        x = np.asarray(x, np.float32)
        for operation, operand in self.steps():
            x = _NUMPY_OPERATIONS[operation](x, operand)
        return x


_NUMPY_OPERATIONS = {"mul": np.multiply, "sub": np.subtract, "div": np.divide}


class TranslatesScaledRows(Protocol[Translation]):
    """The method scaled rows call on a translator (the whole translator:
    :class:`crosstrain.core.data.rows.RowsTranslator`), which translates ``rows.raw`` too."""

    def scaled(self, rows: ScaledRows) -> Translation: ...


class _RawRows(Protocol):
    """What scaled rows read their raw rows through (every kind of rows has it)."""

    def take(self, indices: np.ndarray) -> Any: ...

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray: ...

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows | None: ...


class ScaledRows:
    """Rows read from ``raw`` (an array, or rows of another kind, in its own dtype) and
    returned scaled, as float32."""

    def __init__(self, raw: Any, scaling: InputScaling) -> None:
        self.raw = raw
        self.scaling = scaling
        self._rows: _RawRows = ArrayRows(raw) if isinstance(raw, np.ndarray) else raw

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(np.float32)

    def __len__(self) -> int:
        return int(self.raw.shape[0])

    def __getitem__(self, indices: Any) -> np.ndarray:
        return self.scaling.apply(self.raw[indices])

    def take(self, indices: np.ndarray) -> ScaledRows:
        """Some rows, still raw."""
        return ScaledRows(self._rows.take(indices), self.scaling)

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        return self.scaling.apply(self._rows.gather(indices, epoch))

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows | None:
        """The raw rows as stored: cast to float32 and scaled, they are these rows."""
        return self._rows.stored(indices, epoch)

    def translate(self, translator: TranslatesScaledRows[Translated]) -> Translated:
        return translator.scaled(self)
