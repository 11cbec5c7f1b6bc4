"""What a data set's ``x`` and ``y`` are, described once for every backend: a kind of rows
(:class:`RowKind`), read on the host by index, and translated by each backend into what it
keeps where the model runs.

Every kind answers the same few questions: ``take`` (some rows, unread where the kind can
keep a view), ``gather`` (rows as the model takes them, read in an epoch: core's reference
read), ``stored`` (where they are read from before any cast or scaling) and ``translate``.
A backend never asks which kind it holds: it passes a :class:`RowsTranslator`, one method
per primitive kind, and the rows call theirs (Keras 3's ``distribution_lib`` keeps neutral
descriptions each backend translates the same way). The translator's methods, one per
primitive kind, and what placing each on a device keeps:

- ``array``: a numpy array (:class:`~.arrays.ArrayRows`): the array;
- ``mapped``: rows of a memory-mapped file (:class:`~.mapped.MappedRows`): the file's
  array, and its view's index;
- ``windows``: token windows (:class:`~.tokens.TokenWindows`): the token array;
- ``scaled``: rows scaled as they are read (:class:`~.scaling.ScaledRows`): the raw rows,
  translated in turn;
- ``images``: image files (:class:`~.sources.images.ImageRows`): nothing, they are decoded
  on the host each step;
- ``host``: any other rows read on the host each step (a mixing set's labels, shifted
  token windows): nothing.

A new source produces one of these kinds and touches neither backend. Each kind's module
declares the one translator method it calls (``TranslatesMappedRows``, ...), so the kinds
need not import this module; :class:`RowsTranslator` is all of them.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from crosstrain.core.data.arrays import ArrayRows, StoredRows, Translated, TranslatesArrays, Translation
from crosstrain.core.data.mapped import MappedRows, TranslatesMappedRows
from crosstrain.core.data.scaling import InputScaling, ScaledRows, TranslatesScaledRows
from crosstrain.core.data.sources.images import (
    ImageRows,
    TranslatesImageRows,
    TranslatesMixedTargets,
)
from crosstrain.core.data.sources.text import TranslatesShiftedWindows
from crosstrain.core.data.tokens import TokenWindows, TranslatesTokenWindows


class RowKind(Protocol):
    """A kind of rows, read by an index array (an int64 array of row numbers)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype the model takes the rows in."""
        ...

    def __getitem__(self, indices: Any) -> np.ndarray: ...

    def take(self, indices: np.ndarray) -> Rows:
        """Rows ``indices`` as rows of their own (a view, unread, where the kind keeps one)."""
        ...

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        """Rows ``indices`` as the model takes them, read in ``epoch`` (images: augmented as
        drawn for it; None: not augmented)."""
        ...

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows | None:
        """Where rows ``indices`` are read from before any conversion (cast to :attr:`dtype`
        and scaled by :func:`input_scaling`, they are :meth:`gather`'s rows); None when
        they are more than a gather of stored rows."""
        ...

    def translate(self, translator: RowsTranslator[Translated]) -> Translated:
        """What ``translator`` makes of these rows: the rows call the method of their kind."""
        ...


#: what a data set's ``x`` or ``y`` is: a numpy array, or rows of another kind
Rows = np.ndarray | RowKind


class RowsTranslator(
    TranslatesArrays[Translation],
    TranslatesMappedRows[Translation],
    TranslatesTokenWindows[Translation],
    TranslatesScaledRows[Translation],
    TranslatesImageRows[Translation],
    TranslatesMixedTargets[Translation],
    TranslatesShiftedWindows[Translation],
    Protocol[Translation],
):
    """What a backend implements to translate rows (its gathers on the device, ...): one
    method per primitive kind (the table above). ``scaled`` translates ``rows.raw`` with
    :func:`translate` itself."""

    def host(self, rows: RowKind) -> Translation:
        """Rows read on the host each step, whatever their kind."""
        ...


def row_kind(rows: Rows) -> RowKind:
    """The rows as a kind (a numpy array: :class:`~.arrays.ArrayRows`)."""
    return ArrayRows(rows) if isinstance(rows, np.ndarray) else rows


def translate(rows: Rows, translator: RowsTranslator[Translated]) -> Translated:
    """What ``translator`` makes of ``rows``."""
    return row_kind(rows).translate(translator)


def take_rows(rows: Rows, indices: np.ndarray) -> Rows:
    """Some rows; memory-mapped rows stay a view, unread."""
    return row_kind(rows).take(indices)


def read_rows(rows: Rows, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
    """``rows[indices]``, read in ``epoch`` (image rows: augmented as drawn for it; a mixing
    set's labels: mixed as its images are)."""
    return row_kind(rows).gather(indices, epoch)


def stored_rows(rows: Rows, indices: np.ndarray, epoch: int | None = None) -> StoredRows | None:
    """Where ``rows[indices]`` are read from, before any conversion: the array as stored (a
    memory-mapped file in its own dtype), the indices into its first axis, and the shape
    of the rows read. Cast to ``rows.dtype`` and scaled by :func:`input_scaling`,
    ``array[indices]`` is ``rows[indices]``. Image rows are decoded here (as uint8, in
    ``epoch``: augmented as drawn for it), the array their batch. None for rows that are
    more than a gather (token windows), and for a stored dtype wider than ``rows.dtype``
    (float64 read as float32: narrowed on the host, there are fewer bytes to copy)."""
    found = row_kind(rows).stored(indices, epoch)
    return found if found is not None and found[0].dtype.itemsize <= rows.dtype.itemsize else None


def image_rows(rows: Rows) -> ImageRows | None:
    """The image files ``rows`` decode (scaled or not); None for rows of arrays."""
    return translate(rows, _ImageFiles())


def input_scaling(rows: Rows) -> InputScaling | None:
    """The scaling the rows apply as they are read (``data.scale``, ``mean``, ``std``)."""
    return translate(rows, _Scaling())


class _ImageFiles:
    """The image files rows decode, under their scaling; None for every other kind."""

    def array(self, rows: np.ndarray) -> ImageRows | None:
        return None

    def mapped(self, rows: MappedRows) -> ImageRows | None:
        return None

    def windows(self, rows: TokenWindows) -> ImageRows | None:
        return None

    def scaled(self, rows: ScaledRows) -> ImageRows | None:
        return translate(rows.raw, self)

    def images(self, rows: ImageRows) -> ImageRows | None:
        return rows

    def host(self, rows: RowKind) -> ImageRows | None:
        return None


class _Scaling:
    """The scaling rows apply as they are read; None for every kind but scaled rows."""

    def array(self, rows: np.ndarray) -> InputScaling | None:
        return None

    def mapped(self, rows: MappedRows) -> InputScaling | None:
        return None

    def windows(self, rows: TokenWindows) -> InputScaling | None:
        return None

    def scaled(self, rows: ScaledRows) -> InputScaling | None:
        return rows.scaling

    def images(self, rows: ImageRows) -> InputScaling | None:
        return None

    def host(self, rows: RowKind) -> InputScaling | None:
        return None
