"""Where the tf backend keeps the data, and how a step's rows reach its replicas.

As the torch backend's feed (:mod:`crosstrain.backends.torch.feed`): placed on the device
(``data.placement = "device"``, or ``"auto"`` on a GPU when the arrays fit in
:data:`~crosstrain.backends.placement.AUTO_SHARE` of its free memory), each array becomes a
non-trainable variable made under the distribution's scope, so every replica's device
holds one copy; a step then hands over row indices only, and each replica gathers its
rows from its own copy inside the compiled step. Otherwise the rows are gathered on the
host as their data set stores them (a file's uint8 images stay uint8); each replica casts
and scales its rows inside the compiled step (:meth:`TfFeed.converter`). On GPUs the next
step's rows are read by a background thread and each replica's share copied to its device
while the current step runs (:class:`Prefetcher`); the step takes them as per-replica values.

Integer arrays of a dtype TensorFlow has no GPU gather for (uint8 images, uint16 tokens)
are kept as int32: the values, and so every later cast, are the same.

This module imports tensorflow only inside functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from crosstrain.backends.placement import Placing, should_place
from crosstrain.backends.prefetch import Prefetched
from crosstrain.backends.tf.gpu import free_gpu_bytes
from crosstrain.core.data.batches import ArrayDataset, Batch, Datasets
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.rows import input_scaling, translate
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.data.tokens import TokenWindows
from crosstrain.core.spec.plan import Plan

#: dtypes kept as they are on the device (TensorFlow gathers them on CPUs and GPUs);
#: other integer arrays are widened to int32, other floats to float32, once
_TF_DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)

#: row indices (an int64 tensor) -> the rows, inside a replica's part of the step
Gather = Callable[[Any], Any]
#: rows as stored -> the rows the model takes, inside a replica's part of the step
Convert = Callable[[Any], Any]
#: what a step of rows read on the host converts: x as stored, its dtype and its scaling
Conversion = tuple[np.dtype[Any], InputScaling | None]


def kept_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype an array is placed as."""
    if dtype.type in _TF_DTYPES:
        return dtype
    return np.dtype(np.int32 if np.issubdtype(dtype, np.integer) else np.float32)


class TfFeed:
    """The placed data sets (per data set, gathers of its x and y rows), and the rows of the
    host's data sets read ahead to the replicas' devices."""

    def __init__(self, distribution: Any, device: str, local: int = 1, prefetch: bool | None = None) -> None:
        self.distribution = distribution
        self.device = device  # "cpu" or "gpu": what the replicas compute on
        self._placed: dict[int, tuple[Gather, Gather]] = {}  # id(dataset) -> gathers of x, y
        self._converters: dict[Conversion, Convert] = {}
        # on a CPU there is no copy to overlap: the host is the device (tests ask for it
        # there, on logical devices, to run the same code)
        prefetches = device == "gpu" if prefetch is None else prefetch
        self.prefetcher = Prefetcher(distribution, local) if prefetches else None

    def prefetch(self, batches: Sequence[Batch]) -> None:
        """Start reading a step's rows and copying them to the replicas' devices, when they
        are on the host; :meth:`Prefetcher.take` finds them."""
        source = batches[0].source
        if self.prefetcher is not None and (source is None or self.gathers(source.dataset) is None):
            self.prefetcher.submit(batches)

    @property
    def placed(self) -> bool:
        return bool(self._placed)

    def gathers(self, dataset: ArrayDataset) -> tuple[Gather, Gather] | None:
        """The gathers of a placed data set's x and y rows (None: it is on the host)."""
        return self._placed.get(id(dataset))

    def place(self, plan: Plan, datasets: Datasets) -> None:
        """Copy the data sets to every replica's device when the plan's placement says so."""
        parts = [part for part in (datasets.train, datasets.eval) if part is not None]
        free = free_gpu_bytes if self.device == "gpu" else None
        if not should_place(plan, parts, free, lambda dtype: kept_dtype(dtype).itemsize):
            for part in parts:  # a scaling's variables are made here, on every worker alike
                self.converter(part.x.dtype, input_scaling(part.x))
            return
        gathers = _VariableGathers()
        with self.distribution.scope():
            for part in parts:
                self._placed[id(part)] = (translate(part.x, gathers), translate(part.y, gathers))

    def converter(self, dtype: np.dtype[Any], scaling: InputScaling | None) -> Convert:
        """Rows from the host -> the model's rows: cast to ``dtype``, then scaled (made once
        per conversion, under the distribution's scope: a scaling's operands are variables)."""
        import tensorflow as tf

        key: Conversion = (np.dtype(dtype), scaling)
        if key not in self._converters:
            if scaling is None:
                cast_to = tf.as_dtype(dtype)
                self._converters[key] = lambda rows: tf.cast(rows, cast_to)
            else:
                with self.distribution.scope():
                    self._converters[key] = scaler(scaling)
        return self._converters[key]


def host_inputs(batches: Sequence[Batch]) -> tuple[np.ndarray, np.ndarray, Conversion]:
    """A step's x and y rows read on the host, stacked on a leading micro-batch axis: x as
    its data set stores them (uint8 images stay uint8), with the conversion the step makes."""
    stored = [batch.stored_x() for batch in batches]
    xs, ys = np.stack([rows for rows, _, _ in stored]), np.stack([batch.y for batch in batches])
    _, dtype, scaling = stored[0]
    return xs, ys, (np.dtype(dtype), scaling)


#: each local replica's (x, y) rows on its device, and their conversion
Prefetch = tuple[tuple[tuple[Any, Any], ...], Conversion]


class Prefetcher:
    """One background thread that reads the next step's rows on the host, as their data set
    stores them, and copies each local replica's share to that replica's device while the
    current step runs; the step takes them as per-replica values, with no copy in its path
    (the role of tf.data's prefetch to the device: here the loop, not a dataset, decides the
    steps, and names each one just before the step ahead of it runs)."""

    def __init__(self, distribution: Any, local: int) -> None:
        self.distribution, self.local = distribution, local
        self.devices = tuple(distribution.extended.worker_devices)  # this process's, in order
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crosstrain-prefetch")
        self.pending: Prefetched[Prefetch] = Prefetched()

    def submit(self, batches: Sequence[Batch]) -> None:
        self.pending.put(batches[0], self.pool.submit(self._copy, batches))

    def take(self, batches: Sequence[Batch]) -> tuple[tuple[Any, Any], Conversion] | None:
        """The step's (x, y) as per-replica values on the replicas' devices, and their
        conversion; None when its rows were not read ahead."""
        found = self.pending.take(batches[0])
        if found is None:
            return None
        parts, conversion = found

        def replica_rows(which: int) -> Any:
            return self.distribution.experimental_distribute_values_from_function(
                lambda context: parts[context.replica_id_in_sync_group % self.local][which]
            )

        return (replica_rows(0), replica_rows(1)), conversion

    def _copy(self, batches: Sequence[Batch]) -> Prefetch:
        """Each replica's contiguous share of every micro-batch's rows (as the step's
        :func:`~crosstrain.backends.tf.steps.replica_rows` would cut them), on its device."""
        import tensorflow as tf

        xs, ys, conversion = host_inputs(batches)
        share = xs.shape[1] // self.local  # rows of a micro-batch per replica
        parts = []
        for part, device in enumerate(self.devices):
            mine = slice(part * share, (part + 1) * share)
            with tf.device(device):
                x, y = (tf.identity(np.ascontiguousarray(rows[:, mine])) for rows in (xs, ys))
            parts.append((x, y))
        return tuple(parts), conversion


class _VariableGathers(Placing[Gather]):
    """Rows translated into gathers of a replica's rows from non-trainable variables (made
    under the distribution's scope: one copy per replica device), one per array that
    several parts read."""

    def __init__(self) -> None:
        self._on_device: dict[int, Any] = {}

    def array(self, rows: np.ndarray) -> Gather:
        import tensorflow as tf

        array, dtype = self._variable(rows), tf.as_dtype(rows.dtype)
        return lambda indices: tf.cast(tf.gather(array, indices), dtype)

    def mapped(self, rows: MappedRows) -> Gather:
        """Rows of a memory-mapped file, placed in the file's layout; this view's rows are one
        index away (its own index, placed too), reshaped and cast as the host reads them."""
        import tensorflow as tf

        array = self._variable(rows.array)
        index = None if rows.index is None else self._variable(rows.index)
        shape, dtype = [-1, *rows.row_shape], tf.as_dtype(rows.dtype)

        def gather(indices: Any) -> Any:
            file_rows = indices if index is None else tf.gather(index, indices)
            return tf.cast(tf.reshape(tf.gather(array, file_rows), shape), dtype)

        return gather

    def windows(self, rows: TokenWindows) -> Gather:
        return _window_gather(rows, self._variable(rows.tokens))

    def scaled(self, rows: ScaledRows) -> Gather:
        return _scaled_gather(translate(rows.raw, self), rows.scaling)

    def _variable(self, array: np.ndarray) -> Any:
        """``array`` as a non-trainable variable, once per array (by its id: the data sets
        hold every array they read from while the variables live)."""
        import tensorflow as tf

        key = id(array)
        if key not in self._on_device:
            host = np.ascontiguousarray(array, dtype=kept_dtype(array.dtype))
            self._on_device[key] = tf.Variable(host, trainable=False, name="crosstrain_data")
        return self._on_device[key]


_TF_OPERATIONS = {"mul": "multiply", "sub": "subtract", "div": "divide"}


def scaler(scaling: InputScaling) -> Convert:
    """Raw rows scaled by the same float32 operations, in the same order, as core's numpy
    reference (each correctly rounded: the same bits). The operands are variables, not
    constants: Grappler's constant folding turns a division by a constant into a
    multiplication by its reciprocal, which rounds differently. Call it under the
    distribution's scope (one copy of each operand per replica device)."""
    import tensorflow as tf

    steps = [
        (
            getattr(tf.math, _TF_OPERATIONS[name]),
            tf.Variable(operand, trainable=False, name="crosstrain_scaling"),
        )
        for name, operand in scaling.steps()
    ]

    def scale(raw: Any) -> Any:
        x = tf.cast(raw, tf.float32)
        for operation, operand in steps:
            x = operation(x, operand)
        return x

    return scale


def _scaled_gather(raw: Gather, scaling: InputScaling) -> Gather:
    scale = scaler(scaling)  # the placed rows gathered, then scaled
    return lambda indices: scale(raw(indices))


def _window_gather(windows: TokenWindows, tokens: Any) -> Gather:
    """Row i of the windows, read from the placed token array: tokens[(first+i)*L + offset + k]."""
    import tensorflow as tf

    dtype = tf.as_dtype(windows.dtype)

    def gather(indices: Any) -> Any:
        offsets = tf.range(windows.length, dtype=tf.int64) + windows.offset
        starts = (tf.cast(indices, tf.int64) + windows.first) * windows.length
        return tf.cast(tf.gather(tokens, starts[:, None] + offsets[None, :]), dtype)

    return gather
