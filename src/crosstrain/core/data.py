"""Data sets, the global sampler and the batches every replica sees (DESIGN rule 3).

crosstrain, not the framework, decides which rows form each optimizer step: a
seeded permutation per epoch, cut into global batches, the last one padded with
weight-0 rows. Every replica therefore runs the same number of steps, and world N
sees exactly the rows world 1 sees, in the same global batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np

from crosstrain.core.errors import PlanError
from crosstrain.core.plan import DataSpec, Plan, output_units


@attrs.frozen(eq=False)
class ArrayDataset:
    """Rows of inputs ``x`` (channels-last) and targets ``y``, in memory."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def take(self, indices: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.x[indices], self.y[indices])


@attrs.frozen(eq=False)
class Datasets:
    train: ArrayDataset
    eval: ArrayDataset | None


@attrs.frozen(eq=False)
class Batch:
    """One replica-group's rows. ``weight`` is 1 for a real row and 0 for padding."""

    x: np.ndarray
    y: np.ndarray
    weight: np.ndarray

    @property
    def real_rows(self) -> int:
        return int(self.weight.sum())


@attrs.frozen(eq=False)
class StepBatch:
    """This process's rows for one optimizer step: one Batch per accumulation micro-step.

    ``global_real_rows`` is the number of real rows in the whole global batch, across
    every replica and micro-step: the loss normaliser of DESIGN rule 4.
    """

    micro_batches: tuple[Batch, ...]
    global_real_rows: int


# --------------------------------------------------------------------------- loading


def load_datasets(plan: Plan) -> Datasets:
    """Load and shape the plan's data, checking it against the model; errors name the field."""
    spec = plan.data
    x, y = _load_arrays(spec, spec.path, plan.source)
    if spec.limit is not None:
        x, y = x[: spec.limit], y[: spec.limit]
    x = _fit_to_input(x, plan, "data.path" if spec.source == "npz" else "data.source")
    y = _targets(y, plan)
    full = ArrayDataset(x, y)
    if spec.eval_path is not None:
        eval_x, eval_y = _load_arrays(spec, spec.eval_path, plan.source, field="data.eval_path")
        evaluation = ArrayDataset(_fit_to_input(eval_x, plan, "data.eval_path"), _targets(eval_y, plan))
        return Datasets(train=full, eval=evaluation)
    return _split(full, spec.eval_fraction, plan.seed)


def _load_arrays(
    spec: DataSpec, path: str | None, source: str | None, field: str = "data.path"
) -> tuple[np.ndarray, np.ndarray]:
    if spec.source == "digits" and field == "data.path":
        return _load_digits()
    assert path is not None  # DataSpec refuses source "npz" without a path
    if not Path(path).is_file():
        raise PlanError(f"no such file {path}", field=field, source=source)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            missing = [key for key in (spec.x_key, spec.y_key) if key not in arrays.files]
            if missing:
                raise PlanError(
                    f"{path} has no array {missing[0]!r} (it has {', '.join(arrays.files)})",
                    field="data.x_key" if missing[0] == spec.x_key else "data.y_key",
                    source=source,
                )
            return np.asarray(arrays[spec.x_key]), np.asarray(arrays[spec.y_key])
    except (OSError, ValueError) as error:
        raise PlanError(f"cannot read {path}: {error}", field=field, source=source) from None


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 handwritten digits: real data shipped inside the package."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def _fit_to_input(x: np.ndarray, plan: Plan, field: str) -> np.ndarray:
    """Reshape each row to ``model.input_shape`` (channels-last) when the sizes agree."""
    shape = plan.model.input_shape
    rows = x.shape[0]
    if math.prod(x.shape[1:]) != math.prod(shape):
        raise PlanError(
            f"rows have shape {list(x.shape[1:])}, which does not fit model.input_shape {list(shape)}",
            field=field,
            source=plan.source,
        )
    return np.ascontiguousarray(x.reshape(rows, *shape), dtype=np.float32)


def _targets(y: np.ndarray, plan: Plan) -> np.ndarray:
    units = output_units(plan)
    if plan.loss.name == "cross_entropy":
        if not np.issubdtype(y.dtype, np.integer) and not np.all(np.mod(y, 1) == 0):
            raise PlanError(
                "cross_entropy needs integer class labels", field="data.y_key", source=plan.source
            )
        labels = y.astype(np.int64).reshape(-1)
        if labels.min(initial=0) < 0 or (units is not None and labels.max(initial=0) >= units):
            raise PlanError(
                f"labels span 0..{int(labels.max())} but the model's last layer has {units} units",
                field="model.layers",
                source=plan.source,
            )
        return labels
    targets = y.astype(np.float32).reshape(y.shape[0], -1)
    if units is not None and targets.shape[1] != units:
        raise PlanError(
            f"targets have {targets.shape[1]} columns but the model's last layer has {units} units",
            field="model.layers",
            source=plan.source,
        )
    return targets


def _split(full: ArrayDataset, eval_fraction: float, seed: int) -> Datasets:
    if eval_fraction == 0.0:
        return Datasets(train=full, eval=None)
    order = np.random.default_rng([seed, 0xE7A1]).permutation(len(full))
    eval_rows = max(1, round(len(full) * eval_fraction))
    return Datasets(train=full.take(np.sort(order[eval_rows:])), eval=full.take(np.sort(order[:eval_rows])))


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
    """Pad with row 0 at weight 0: padding keeps shapes static and never counts."""
    weight = np.zeros(size, np.float32)
    weight[: len(indices)] = 1.0
    padded = np.zeros(size, np.int64)
    padded[: len(indices)] = indices
    return padded, weight


def eval_batches(dataset: ArrayDataset, global_batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The eval set in order, in padded global batches."""
    return GlobalSampler(len(dataset), global_batch_size, seed=0, shuffle=False).epoch(0)


def shard(dataset: ArrayDataset, indices: np.ndarray, weight: np.ndarray, part: int, parts: int) -> Batch:
    """Contiguous slice ``part`` of ``parts`` of a global batch, as a Batch."""
    size = len(indices) // parts
    rows = slice(part * size, (part + 1) * size)
    return Batch(dataset.x[indices[rows]], dataset.y[indices[rows]], weight[rows])


def step_batch(
    dataset: ArrayDataset,
    indices: np.ndarray,
    weight: np.ndarray,
    process_index: int,
    process_count: int,
    grad_accum_steps: int,
) -> StepBatch:
    """This process's share of one optimizer step.

    The global batch is cut into ``grad_accum_steps`` contiguous micro-batches, and each
    micro-batch into ``process_count`` contiguous slices; a process with several local
    replicas splits its slice among them, again contiguously.
    """
    micro = len(indices) // grad_accum_steps
    batches = tuple(
        shard(
            dataset,
            indices[m * micro : (m + 1) * micro],
            weight[m * micro : (m + 1) * micro],
            process_index,
            process_count,
        )
        for m in range(grad_accum_steps)
    )
    return StepBatch(batches, global_real_rows=int(weight.sum()))
