"""Arrays handed to :func:`crosstrain.fit` from Python, as a run reads them: ``.npy`` files.

``fit(plan, x=..., y=..., eval=(x_eval, y_eval))`` takes numpy arrays and any array that
speaks DLPack or ``__array__`` (torch, tf, jax, CuPy). Each is copied to the host once, in
the calling process (a CUDA array is copied off its device once, not once per worker),
checked against the plan (one line naming the argument, before anything is written), and
written once into the run folder's ``arrays/``. The plan then reads them as
``source = "npy"``: every worker memory-maps the same files (no array is pickled to a
worker), and the run folder alone reproduces the run (``--resume``, ``evaluate``).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from crosstrain.core.errors import InputError
from crosstrain.core.run.targets import TargetMisfit, fit_targets
from crosstrain.core.spec.data_spec import DataSpec
from crosstrain.core.spec.plan import Plan

ARRAYS_DIR = "arrays"
#: the argument -> its file in ARRAYS_DIR and the DataSpec field that names the file
FILES = {
    "x": ("x.npy", "x_path"),
    "y": ("y.npy", "y_path"),
    "eval x": ("eval_x.npy", "eval_x_path"),
    "eval y": ("eval_y.npy", "eval_y_path"),
}
#: numpy's kinds of numbers: booleans, signed and unsigned integers, floats
_NUMBERS = "biuf"
#: what a host copy of a device array is asked for, in order: the DLPack protocol's own copy
#: to the CPU, then the methods torch (``cpu``) and CuPy (``get``) name it by
_TO_HOST: tuple[Callable[[Any], Any], ...] = (
    lambda value: np.from_dlpack(value, device="cpu", copy=True),
    lambda value: value.cpu(),
    lambda value: value.get(),
)


@attrs.frozen
class GivenArrays:
    """``x``, ``y`` and the optional eval pair, on the host, checked against the plan."""

    x: np.ndarray
    y: np.ndarray
    eval_x: np.ndarray | None = None
    eval_y: np.ndarray | None = None

    def named(self) -> dict[str, np.ndarray]:
        arrays = {"x": self.x, "y": self.y, "eval x": self.eval_x, "eval y": self.eval_y}
        return {name: array for name, array in arrays.items() if array is not None}


def given_arrays(plan: Plan, x: Any, y: Any, evaluation: Any) -> GivenArrays:
    """The arrays of a ``fit`` call on the host, each checked against ``plan``; a bad one is
    an :class:`InputError` naming the argument."""
    if x is None or y is None:
        raise InputError("fit: x and y come together (the training rows and their targets)")
    arrays = GivenArrays(host_array(x, "x"), host_array(y, "y"), *_eval_pair(evaluation))
    for prefix in ("", "eval "):
        rows, targets = arrays.named().get(f"{prefix}x"), arrays.named().get(f"{prefix}y")
        if rows is not None and targets is not None:
            _check_pair(plan, rows, targets, prefix)
    return arrays


def _eval_pair(evaluation: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    if evaluation is None:
        return None, None
    if not isinstance(evaluation, tuple | list) or len(evaluation) != 2:
        raise InputError("fit: eval is a pair (x_eval, y_eval)")
    return host_array(evaluation[0], "eval x"), host_array(evaluation[1], "eval y")


def host_array(value: Any, name: str) -> np.ndarray:
    """``value`` as a numpy array on the host: numpy as it is, a CPU array through DLPack
    without a copy, a device array copied to the host once, else ``__array__``."""
    array = _on_the_host(value, name)
    if array.dtype.kind not in _NUMBERS:
        raise InputError(f"fit: {name} is no array of numbers ({type(value).__name__} of {array.dtype})")
    return array


def _on_the_host(value: Any, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)  # a CPU array: shared, not copied
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass  # on a device: copied below
        for to_host in _TO_HOST:
            try:
                return np.asarray(to_host(value))
            except (AttributeError, BufferError, RuntimeError, TypeError, ValueError):
                continue
    try:
        return np.asarray(value)
    except (RuntimeError, TypeError, ValueError) as error:
        raise InputError(
            f"fit: {name} is no array numpy can read ({type(value).__name__}: {error})"
        ) from None


def _check_pair(plan: Plan, x: np.ndarray, y: np.ndarray, prefix: str) -> None:
    name_x, name_y = f"{prefix}x", f"{prefix}y"
    shape = plan.model.input_shape
    if x.ndim < 1 or math.prod(x.shape[1:]) != math.prod(shape):
        raise InputError(
            f"fit: {name_x} has rows of shape {list(x.shape[1:])}, which does not fit "
            f"model.input_shape {list(shape)} (x is [rows, *input_shape])"
        )
    if y.ndim < 1 or len(y) != len(x):
        raise InputError(f"fit: {name_y} has {len(y) if y.ndim else 0} rows but {name_x} has {len(x)}")
    if len(x) == 0:
        raise InputError(f"fit: {name_x} has no rows")
    for name, array in ((name_x, x), (name_y, y)):
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
            raise InputError(f"fit: {name} holds NaN or infinite values")
    try:
        fit_targets(y, plan)
    except TargetMisfit as misfit:
        raise InputError(f"fit: {name_y}: {misfit}") from None


def write_arrays(run_dir: Path, arrays: GivenArrays) -> dict[str, str]:
    """Each array as ``run_dir/arrays/<name>.npy``, written whole before it takes its name
    (a file of that name is always complete); the DataSpec fields naming them. Call it once
    the folder is known to take a new run: an earlier fit's arrays there are replaced."""
    folder = run_dir / ARRAYS_DIR
    if folder.is_dir():  # an earlier fit's, in a folder the caller may replace
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    fields: dict[str, str] = {}
    for name, array in arrays.named().items():
        file_name, field = FILES[name]
        path = folder / file_name
        partial = path.with_suffix(".partial.npy")
        np.save(partial, np.ascontiguousarray(array))
        os.replace(partial, path)
        fields[field] = str(path.resolve())
    return fields


def reading_the_arrays(plan: Plan, fields: dict[str, str]) -> Plan:
    """``plan`` reading the written arrays (source "npy"), keeping what applies to any array
    source: the row limit, the eval fraction (with no eval pair), shuffling, placement and
    the input scaling."""
    data = plan.data
    kept = {
        name: getattr(data, name)
        for name in ("limit", "eval_fraction", "shuffle", "placement", "scale", "mean", "std")
    }
    return attrs.evolve(plan, data=DataSpec(source="npy", **kept, **fields))  # type: ignore[arg-type]
