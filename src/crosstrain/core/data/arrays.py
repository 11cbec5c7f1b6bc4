"""Rows held in memory: a numpy array seen as a kind of rows (:class:`ArrayRows`), and what
every kind shares at the bottom: :data:`StoredRows`, where rows are read from before any
conversion, and the type variables of the translators kinds call.

The protocol itself, and the translator it is read through, are in
:mod:`crosstrain.core.data.rows`; this module stands below every kind so that each may
use it (scaled rows wrap an array like any other kind).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import numpy as np

#: where rows ``indices`` are read from before any conversion: the array as stored, the
#: indices into its first axis, and the shape of the rows read (``array[indices]``
#: reshaped so, cast and scaled as the kind says, is the rows)
StoredRows = tuple[np.ndarray, np.ndarray, tuple[int, ...]]

#: what a translator makes of rows (a backend's gather, the bytes placing them takes, ...)
Translation = TypeVar("Translation", covariant=True)
Translated = TypeVar("Translated")


class TranslatesArrays(Protocol[Translation]):
    """The method arrays call on a translator (the whole translator:
    :class:`crosstrain.core.data.rows.RowsTranslator`)."""

    def array(self, rows: np.ndarray) -> Translation: ...


class ArrayRows:
    """An array's rows, ``array[i]`` for row i: how the functions of
    :mod:`~crosstrain.core.data.rows` read a plain numpy array (a data set's labels, a
    table's columns) through the same protocol as every other kind."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.array.dtype

    def __getitem__(self, indices: Any) -> np.ndarray:
        return np.asarray(self.array[indices])

    def take(self, indices: np.ndarray) -> np.ndarray:
        taken: np.ndarray = self.array[indices]
        return taken

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        return np.asarray(self.array[indices])

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows:
        return self.array, indices, (len(indices), *self.array.shape[1:])

    def translate(self, translator: TranslatesArrays[Translated]) -> Translated:
        return translator.array(self.array)
