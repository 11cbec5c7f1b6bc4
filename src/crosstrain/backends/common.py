"""Small helpers shared by backends that need no framework: free ports, native factories,
CPU threads, the decision to place the data on the device, and the bookkeeping of rows
read ahead by a background thread."""

from __future__ import annotations

import importlib
import socket
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from crosstrain.core.data.batches import ArrayDataset, Rows, image_rows
from crosstrain.core.data.mapped import MappedRows
from crosstrain.core.data.scaling import ScaledRows
from crosstrain.core.data.tokens import TokenWindows
from crosstrain.core.errors import PlanError
from crosstrain.core.spec.plan import Plan

#: threads a worker process computes with on a CPU (torch's, and each of TensorFlow's two
#: pools): N workers on N cores each spawning N threads run ~7x slower (measured, 2 cores)
CPU_THREADS = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, chosen by the kernel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def native_factory(plan: Plan, backend: str) -> Callable[[Plan], Any]:
    """Resolve the plan's ``"module:function"`` native model factory for ``backend``."""
    assert plan.model.native is not None
    target = plan.model.native.factory_for(backend)
    if target is None:
        raise PlanError(
            f"the native model names no factory for backend {backend!r}",
            field="model.native",
            source=plan.source,
        )
    module_name, _, function_name = target.partition(":")
    _put_plan_folder_on_path(plan)
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise PlanError(
            f"cannot load {target!r}: {error}", field=f"model.native.{backend}", source=plan.source
        ) from None
    if not callable(factory):
        raise PlanError(f"{target!r} is not callable", field=f"model.native.{backend}", source=plan.source)
    return factory  # type: ignore[no-any-return]


def _put_plan_folder_on_path(plan: Plan) -> None:
    """A module beside the plan file imports as it would beside a script run with python:
    the plan's folder comes first on the worker's import path."""
    if plan.source is None or not Path(plan.source).is_file():
        return
    folder = str(Path(plan.source).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)


# --------------------------------------------------------------------------- data placement

#: "auto" places the data when it takes at most this share of the device's free memory
AUTO_SHARE = 0.25


def should_place(
    plan: Plan,
    parts: Iterable[ArrayDataset],
    free_device_bytes: Callable[[], int | None] | None,
    itemsize: Callable[[np.dtype[Any]], int] = lambda dtype: dtype.itemsize,
) -> bool:
    """``data.placement``: "host" never, "device" always, "auto" when the device is an
    accelerator (``free_device_bytes`` given: on a CPU the host already is the device) whose
    free memory is known and holds the arrays in :data:`AUTO_SHARE` of it. ``itemsize``:
    the bytes per value the backend will keep (it may widen a dtype its device lacks)."""
    placement = plan.data.placement
    if placement != "auto":
        return placement == "device"
    parts = list(parts)
    if any(image_rows(part.x) is not None for part in parts):
        return False  # image files are decoded each step, on the host
    free = free_device_bytes() if free_device_bytes is not None else None
    return free is not None and placed_bytes(parts, itemsize) <= AUTO_SHARE * free


def placed_arrays(rows: Rows) -> list[np.ndarray]:
    """The host arrays a data set's ``x`` or ``y`` reads from (what placing copies)."""
    if isinstance(rows, ScaledRows):
        return placed_arrays(rows.raw)
    if isinstance(rows, TokenWindows):
        return [rows.tokens]
    if isinstance(rows, MappedRows):
        return [rows.array] if rows.index is None else [rows.array, rows.index]
    if not isinstance(rows, np.ndarray):
        raise unplaceable(rows)
    return [rows]


def placed_bytes(
    parts: Iterable[ArrayDataset], itemsize: Callable[[np.dtype[Any]], int] = lambda dtype: dtype.itemsize
) -> int:
    """Device bytes the parts would take, an array shared by several parts counted once."""
    arrays = {
        id(array): array for part in parts for rows in (part.x, part.y) for array in placed_arrays(rows)
    }
    return sum(array.size * itemsize(array.dtype) for array in arrays.values())


def unplaceable(rows: object) -> PlanError:
    """The refusal of rows no backend knows how to place."""
    return PlanError(f"cannot place {type(rows).__name__} rows on the device", field="data.placement")


# --------------------------------------------------------------------------- prefetching

#: the longest a step waits for the rows a background thread is reading for it
PREFETCH_TIMEOUT_SECONDS = 300.0

_Result = TypeVar("_Result")


class Prefetched(Generic[_Result]):
    """Work started in the background for the steps the loop names ahead, found again by
    each step's first batch (the loop hands the same objects to ``train_step``). A step
    the loop never named finds nothing and is read in the step, as without prefetching."""

    def __init__(self, timeout_seconds: float = PREFETCH_TIMEOUT_SECONDS) -> None:
        self.timeout_seconds = timeout_seconds
        self._pending: dict[int, tuple[object, Future[_Result]]] = {}
        self.taken = 0  # steps that found their rows read ahead

    def put(self, batch: object, work: Future[_Result]) -> None:
        self._pending[id(batch)] = (batch, work)

    def take(self, batch: object) -> _Result | None:
        """The work's result for ``batch`` (waiting at most the deadline), or None when no
        work was started for it."""
        entry = self._pending.pop(id(batch), None)
        if entry is None or entry[0] is not batch:
            return None
        result = self._result(entry[1])
        self.taken += 1
        return result

    def settle(self) -> None:
        """Wait until every piece of work started is done."""
        for _, work in self._pending.values():
            self._result(work)

    def _result(self, work: Future[_Result]) -> _Result:
        try:
            return work.result(timeout=self.timeout_seconds)
        except TimeoutError:
            raise TimeoutError(f"reading a batch's rows took more than {self.timeout_seconds:g} s") from None
