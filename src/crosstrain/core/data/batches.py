"""Data sets, the global sampler and the batches every replica sees, made by crosstrain.

crosstrain, not the framework, decides which rows form each optimizer step: a
seeded permutation per epoch, cut into global batches, the last one padded with
weight-0 rows. Every replica therefore runs the same number of steps, and world N
sees exactly the rows world 1 sees, in the same global batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np

from crosstrain.core.data.rows import Rows, input_scaling, read_rows, stored_rows, take_rows
from crosstrain.core.data.scaling import InputScaling
from crosstrain.core.data.sources import table as tables


@attrs.frozen(eq=False)
class ArrayDataset:
    """Rows of inputs ``x`` (channels-last) and targets ``y``: each a numpy array or rows of
    another kind (:mod:`crosstrain.core.data.rows`)."""

    x: Rows
    y: Rows

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def targets_per_row(self) -> int:
        """Target positions in one row: 1 for a label, the sequence length for tokens."""
        # labels (cross_entropy) are integers, one per position; regression targets are
        # floats averaged within their row
        return math.prod(self.y.shape[1:]) if self.y.dtype.kind in "iu" else 1

    def take(self, indices: np.ndarray) -> ArrayDataset:
        """Some rows; memory-mapped rows stay a view, unread."""
        return ArrayDataset(take_rows(self.x, indices), take_rows(self.y, indices))


@attrs.frozen(eq=False)
class Datasets:
    train: ArrayDataset
    eval: ArrayDataset | None
    #: a table's statistics (codes, mean, std), kept or computed from its training rows
    statistics: tables.TableStatistics | None = None


@attrs.frozen(eq=False)
class RowSource:
    """Where a batch's rows live: the data set and the row indices to read from it, and the
    epoch they are read in (what a training image's augmentation draws hash; None: none)."""

    dataset: ArrayDataset
    indices: np.ndarray
    epoch: int | None = None


@attrs.define(eq=False)
class Batch:
    """One replica-group's rows. ``weight`` is 1 for a real row and 0 for padding; ``rows``
    is each row's position in the step's global batch (what dropout masks hash).

    The loop hands backends *index* batches (``source``: the data set and row indices), so
    a backend that keeps the data on its device gathers the rows there; ``x``/``y`` read
    them on the host, once, the first time they are asked for. A batch may also be built
    from arrays directly."""

    _x: np.ndarray | None = attrs.field(alias="x")
    _y: np.ndarray | None = attrs.field(alias="y")
    weight: np.ndarray
    rows: np.ndarray = attrs.field()
    source: RowSource | None = attrs.field(default=None, kw_only=True)

    @rows.default
    def _rows_from_zero(self) -> np.ndarray:
        return np.arange(len(self.weight), dtype=np.int64)

    @classmethod
    def of_rows(
        cls,
        dataset: ArrayDataset,
        indices: np.ndarray,
        weight: np.ndarray,
        rows: np.ndarray,
        epoch: int | None = None,
    ) -> Batch:
        return cls(None, None, weight, rows, source=RowSource(dataset, indices, epoch))

    @property
    def x(self) -> np.ndarray:
        if self._x is None:
            self._x = self._gather("x")
        return self._x

    @property
    def y(self) -> np.ndarray:
        # each on its own: a backend that reads x as stored (stored_x) never reads it here
        if self._y is None:
            self._y = self._gather("y")
        return self._y

    def stored_x(self) -> tuple[np.ndarray, np.dtype[Any], InputScaling | None]:
        """The x rows as their data set stores them (a file's uint8 images stay uint8), the
        dtype of :attr:`x`, and the scaling (None: none): cast to that dtype, then scaled,
        they are ``x``. A backend that converts where the model runs copies these rows, a
        quarter of the bytes of float32 ones for uint8 images."""
        source, found = self.source, None
        if self._x is None and source is not None:
            found = stored_rows(source.dataset.x, source.indices, source.epoch)
        if found is None:
            return self.x, self.x.dtype, None
        assert source is not None
        array, indices, shape = found
        rows = source.dataset.x
        return np.asarray(array[indices]).reshape(shape), rows.dtype, input_scaling(rows)

    def _gather(self, name: str) -> np.ndarray:
        assert self.source is not None, "a batch holds either arrays or a row source"
        return read_rows(getattr(self.source.dataset, name), self.source.indices, self.source.epoch)

    @property
    def real_rows(self) -> int:
        return int(self.weight.sum())


@attrs.frozen(eq=False)
class StepBatch:
    """This process's rows for one optimizer step: one Batch per accumulation micro-step.

    ``global_real_rows`` is the number of real rows in the whole global batch, across
    every replica and micro-step; ``global_real_targets`` the number of real target
    positions in it (rows x positions per row for token targets): the loss normaliser of
    every backend. ``step`` counts optimizer steps from 0 (what dropout masks hash).
    """

    micro_batches: tuple[Batch, ...]
    global_real_rows: int
    step: int = 0
    targets_per_row: int = 1

    @property
    def global_real_targets(self) -> int:
        return self.global_real_rows * self.targets_per_row


# --------------------------------------------------------------------------- sampling


@attrs.frozen
class GlobalSampler:
    """Seeded global batches: every row once per epoch, the last batch padded with weight 0."""

    num_rows: int
    global_batch_size: int
    seed: int
    shuffle: bool = True

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.global_batch_size)

    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (row indices, weights) per global batch, each exactly global_batch_size long."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        for start in range(0, self.num_rows, self.global_batch_size):
            yield _padded(order[start : start + self.global_batch_size], self.global_batch_size)


def _padded(indices: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad with row 0 at weight 0: padding keeps shapes static and never counts. A full
    batch stays a view of the epoch's order (a backend may copy that order to the device
    once an epoch and slice it there: :func:`epoch_slice`)."""
    if len(indices) == size:
        return indices, np.ones(size, np.float32)
    weight = np.zeros(size, np.float32)
    weight[: len(indices)] = 1.0
    padded = np.zeros(size, np.int64)
    padded[: len(indices)] = indices
    return padded, weight


def epoch_slice(indices: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(the epoch's order, where ``indices`` start in it) when ``indices`` are a contiguous
    slice of a 1-D int64 order (every full batch of :meth:`GlobalSampler.epoch`, and
    each replica's and micro-batch's part of one); None otherwise (a padded batch)."""
    order = indices.base
    if (
        not isinstance(order, np.ndarray)
        or order.ndim != 1
        or order.dtype != np.int64
        or indices.dtype != np.int64
        or not order.flags.c_contiguous
        or indices.strides != (order.itemsize,)
    ):
        return None
    start = (indices.__array_interface__["data"][0] - order.__array_interface__["data"][0]) // order.itemsize
    return order, start


def eval_batches(dataset: ArrayDataset, global_batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The eval set in order, in padded global batches."""
    return GlobalSampler(len(dataset), global_batch_size, seed=0, shuffle=False).epoch(0)


def shard(
    dataset: ArrayDataset,
    indices: np.ndarray,
    weight: np.ndarray,
    part: int,
    parts: int,
    epoch: int | None = None,
) -> Batch:
    """Contiguous slice ``part`` of ``parts`` of a global batch, as a Batch (read in
    ``epoch``: training rows are; evaluation rows are not)."""
    size = len(indices) // parts
    rows = slice(part * size, (part + 1) * size)
    positions = np.arange(part * size, (part + 1) * size, dtype=np.int64)
    return Batch.of_rows(dataset, indices[rows], weight[rows], positions, epoch)


def step_batch(
    dataset: ArrayDataset,
    indices: np.ndarray,
    weight: np.ndarray,
    process_index: int,
    process_count: int,
    grad_accum_steps: int,
    step: int = 0,
    epoch: int | None = None,
) -> StepBatch:
    """This process's share of one optimizer step.

    The global batch is cut into ``grad_accum_steps`` contiguous micro-batches, and each
    micro-batch into ``process_count`` contiguous slices; a process with several local
    replicas splits its slice among them, again contiguously. Each row keeps its position
    in the whole global batch (``Batch.rows``). ``epoch``: the one the rows are read in
    (what an image's augmentation draws hash).
    """
    micro = len(indices) // grad_accum_steps
    batches = []
    for m in range(grad_accum_steps):
        part = shard(
            dataset,
            indices[m * micro : (m + 1) * micro],
            weight[m * micro : (m + 1) * micro],
            process_index,
            process_count,
            epoch,
        )
        part.rows = part.rows + m * micro
        batches.append(part)
    return StepBatch(
        tuple(batches), global_real_rows=int(weight.sum()), step=step, targets_per_row=dataset.targets_per_row
    )
