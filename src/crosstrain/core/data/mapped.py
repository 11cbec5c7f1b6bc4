"""Arrays larger than memory: ``.npy`` files memory-mapped and read by row index.

:class:`MappedRows` never loads its file whole: a step reads the rows it needs, and every
local worker maps the same file, so the page cache holds one copy for all of them. Rows
keep the file's dtype until they are read (raw uint8 images stay uint8 until a backend
places them on its device); reading reshapes them to the model's input shape and casts
them to the dtype the model takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from crosstrain.core.data.arrays import StoredRows, Translated, Translation
from crosstrain.core.errors import PlanError


class TranslatesMappedRows(Protocol[Translation]):
    """The method memory-mapped rows call on a translator (the whole translator:
    :class:`crosstrain.core.data.rows.RowsTranslator`)."""

    def mapped(self, rows: MappedRows) -> Translation: ...


class MappedRows:
    """Rows ``index`` (all when None) of a memory-mapped array, each shaped ``row_shape``
    and read as ``dtype``."""

    def __init__(
        self, array: np.ndarray, row_shape: tuple[int, ...], dtype: Any, index: np.ndarray | None = None
    ) -> None:
        self.array = array
        self.row_shape = row_shape
        self.dtype = np.dtype(dtype)
        self.index = index

    @property
    def shape(self) -> tuple[int, ...]:
        rows = len(self.array) if self.index is None else len(self.index)
        return (rows, *self.row_shape)

    def __len__(self) -> int:
        return self.shape[0]

    def file_rows(self, indices: Any) -> np.ndarray:
        """Which rows of the file ``indices`` of this view are."""
        return np.asarray(indices) if self.index is None else self.index[indices]

    def __getitem__(self, indices: Any) -> np.ndarray:
        rows = np.atleast_1d(self.file_rows(indices))
        data = np.asarray(self.array[rows]).reshape(len(rows), *self.row_shape).astype(self.dtype)
        return data if np.ndim(indices) else data[0]

    def take(self, indices: np.ndarray) -> MappedRows:
        """A view of some rows, still not read."""
        return MappedRows(self.array, self.row_shape, self.dtype, self.file_rows(indices))

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        return self[indices]

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows:
        """The file's rows in its own dtype (uint8 images stay uint8)."""
        return self.array, np.asarray(self.file_rows(indices)), (len(indices), *self.row_shape)

    def translate(self, translator: TranslatesMappedRows[Translated]) -> Translated:
        return translator.mapped(self)


def map_npy(path: str | None, field: str, source: str | None) -> np.ndarray:
    """A .npy file memory-mapped read-only; a missing or bad file is one PlanError."""
    assert path is not None  # DataSpec refuses source "npy" without its paths
    if not Path(path).is_file():
        raise PlanError(f"no such file {path}", field=field, source=source)
    try:
        array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise PlanError(f"cannot read {path}: {error}", field=field, source=source) from None
    if array.ndim == 0:
        raise PlanError(f"{path} holds a scalar, not rows", field=field, source=source)
    return array
