"""``train.shard = "optimizer"`` on tf: ZeRO-1, the optimizer's state split over the replicas.

tf.distribute has no sharded optimizer, so this is crosstrain's own, the torch backend's
(``backends/torch/zero.py``) in tf.distribute's terms. The trainable variables, laid end to
end (each flattened row-major), are cut into one run of ceil(total / N) elements per replica.
Each replica keeps the optimizer's slots of its run alone, in one flat variable per slot kind
that is synchronised on read (each replica's copy holds a different run). After the
gradients' all-reduce (the same as ``"none"``'s) each replica updates its run's elements with
the plan's rule and all-gathers the runs, and every copy of every variable is assigned the
gathered value. The rules are elementwise, so every element's update is the unsharded
step's arithmetic on the same gradient: a run equals the ``"none"`` run of the same world.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from crosstrain.backends.tf.optimizer import UpdateRule
from crosstrain.core.run.checkpoint import StreamedTensors


@attrs.frozen
class Piece:
    """Elements ``[start, stop)`` of trainable variable ``variable`` (row-major), held at
    ``offset`` in its owner's run."""

    variable: int
    start: int
    stop: int
    offset: int


def cut_into_runs(sizes: Sequence[int], replicas: int) -> tuple[int, list[list[Piece]]]:
    """The run length and each replica's pieces: variables of ``sizes`` elements laid end to
    end and cut into ``replicas`` runs of ceil(total / N) elements (the last may be shorter)."""
    length = max(1, -(-sum(sizes) // replicas))
    pieces: list[list[Piece]] = [[] for _ in range(replicas)]
    offset = 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            owner = (offset + start) // length
            stop = min(size, (owner + 1) * length - offset)
            pieces[owner].append(Piece(index, start, stop, offset + start - owner * length))
            start = stop
        offset += size
    return length, pieces


@attrs.define
class ShardedSlots:
    """The optimizer's slots, one flat variable per slot kind, each replica's copy its run.
    ``local``: the replicas of this process, by their id in the sync group, in the order of
    the variables' local copies."""

    length: int
    pieces: list[list[Piece]]
    flats: tuple[Any, ...]
    shapes: list[tuple[int, ...]]
    local: list[int] = attrs.field(factory=list)

    def slot(self, variable: int, kind: int) -> np.ndarray:
        """Slot ``kind`` of trainable variable ``variable`` as this process's replicas hold
        it: their elements, zero elsewhere (every element has one owner, so summing every
        process's array gives the whole slot exactly)."""
        shape = self.shapes[variable]
        values = np.zeros(int(np.prod(shape, dtype=np.int64)), self.flats[kind].dtype.as_numpy_dtype)
        for replica, run in zip(self.local, self.flats[kind].values, strict=True):
            held = run.numpy()
            for piece in self.pieces[replica]:
                if piece.variable == variable:
                    values[piece.start : piece.stop] = held[
                        piece.offset : piece.offset + piece.stop - piece.start
                    ]
        return values.reshape(shape)

    def load(self, slot: Callable[[int, int], np.ndarray | None]) -> None:
        """Each local replica's runs from the whole slots ``slot(variable, kind)`` (None: zero)."""
        for kind, flat in enumerate(self.flats):
            for replica, run in zip(self.local, flat.values, strict=True):
                values = np.zeros(self.length, flat.dtype.as_numpy_dtype)
                for piece in self.pieces[replica]:
                    whole = slot(piece.variable, kind)
                    if whole is not None:
                        part = np.asarray(whole).reshape(-1)[piece.start : piece.stop]
                        values[piece.offset : piece.offset + piece.stop - piece.start] = part
                run.assign(values)

    def streamed(
        self,
        positions: Mapping[str, tuple[int, int]],
        scalars: Mapping[str, np.ndarray],
        dtype: np.dtype[Any],
        gather: Callable[[np.ndarray], np.ndarray] | None,
    ) -> StreamedTensors:
        """The slots under their neutral names (``positions``: name -> (variable, kind)) and
        the ``scalars``, each slot assembled as a checkpoint reads it: this process's
        replicas' elements, summed over the processes by ``gather`` (None: one process)."""
        specs = {name: (self.shapes[index], dtype) for name, (index, _) in positions.items()}
        specs.update({name: (value.shape, value.dtype) for name, value in scalars.items()})

        def read(name: str) -> np.ndarray:
            if name in scalars:
                return scalars[name]
            values = self.slot(*positions[name])
            if gather is not None:
                values = gather(values).sum(axis=0)
            return np.asarray(values, dtype)

        return StreamedTensors(specs, read)

    def bytes_held(self) -> int:
        """What one replica holds: its run of every slot kind."""
        return sum(self.length * flat.dtype.size for flat in self.flats)


def make_sharded_slots(distribution: Any, count: int, variables: Sequence[Any]) -> ShardedSlots:
    """Zeroed runs of ``count`` slot kinds over ``variables`` (the trainable ones, of one
    dtype), under ``distribution``'s scope."""
    import tensorflow as tf

    dtypes = {variable.dtype for variable in variables}
    if len(dtypes) > 1:
        raise ValueError(
            f"train.shard = 'optimizer' needs one dtype for every trainable variable, not {dtypes}"
        )
    shapes = [tuple(variable.shape.as_list()) for variable in variables]
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    length, pieces = cut_into_runs(sizes, distribution.num_replicas_in_sync)
    dtype = next(iter(dtypes)) if dtypes else tf.float32
    with distribution.scope():
        flats = tuple(
            tf.Variable(
                tf.zeros([length], dtype),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.NONE,
            )
            for _ in range(count)
        )
    ids = tf.function(
        lambda: distribution.run(
            lambda: tf.identity(tf.distribute.get_replica_context().replica_id_in_sync_group)
        )
    )()
    local = [int(value.numpy()) for value in distribution.experimental_local_results(ids)]
    return ShardedSlots(length, pieces, flats, shapes, local)


def update_run(
    sharded: ShardedSlots,
    variables: Sequence[Any],
    grads: Sequence[Any],
    rules: Sequence[UpdateRule],
    scalars: Any,
    finite: Any,
    guarded: bool,
) -> list[Any]:
    """In a replica's context: update this replica's run of the variables with the summed
    ``grads`` (its slots too; an inf/nan step under ``guarded`` keeps both), all-gather the
    runs, and give every variable's new value."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    values: list[Any] = []
    states: list[tuple[Any, ...]] = []
    for piece in sharded.pieces[int(replica)]:
        old = tf.reshape(variables[piece.variable], [-1])[piece.start : piece.stop]
        grad = tf.reshape(grads[piece.variable], [-1])[piece.start : piece.stop]
        held = slice(piece.offset, piece.offset + piece.stop - piece.start)
        state = tuple(flat[held] for flat in sharded.flats)
        value, new_state = rules[piece.variable](old, grad, state, scalars)
        if guarded:
            value = tf.where(finite, value, old)
            new_state = tuple(tf.where(finite, new, kept) for new, kept in zip(new_state, state, strict=True))
        values.append(value)
        states.append(new_state)
    padding = sharded.length - sum(piece.stop - piece.start for piece in sharded.pieces[int(replica)])
    for kind, flat in enumerate(sharded.flats):
        flat.assign(tf.concat([state[kind] for state in states] + [tf.zeros([padding], flat.dtype)], 0))
    run = tf.concat([*values, tf.zeros([padding], variables[0].dtype)], 0)
    whole = context.all_gather(run, axis=0)
    updated, offset = [], 0
    for variable, shape in zip(variables, sharded.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        updated.append(tf.reshape(whole[offset : offset + size], variable.shape))
        offset += size
    return updated
