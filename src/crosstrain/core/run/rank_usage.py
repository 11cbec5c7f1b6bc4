"""Per-rank facts for summary.json: where the time went, peak memory, GPU utilisation.

``ranks`` in summary.json holds one entry per process: ``data_seconds`` (building each
step's batch on the host: the time the device may have waited for data),
``step_seconds`` (handing steps to the backend and reading their losses), ``cpu_seconds``
(the CPU time of every thread of the process while it trained: set against the wall
clock, what the steps cost whatever else the machine runs), the peak host memory, and,
from backends that can say (:class:`~crosstrain.core.run.strategy.ReportsDevice`), the peak
device memory and the GPU's mean utilisation while training (NVML). ``memory_per_rank``
holds the bytes of parameters, gradients and optimizer state of the rank that holds the
most (:func:`largest_rank_memory`): what ``train.shard`` divides.
Framework-free: a backend hands :class:`GpuUtilisation` its own NVML reader.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: the per-rank fields, in the order they travel in one all-reduce
RANK_FIELDS = (
    "data_seconds",
    "step_seconds",
    "cpu_seconds",
    "peak_host_memory_bytes",
    "peak_device_memory_bytes",
    "gpu_utilisation_percent",
    "cuda_graph_steps",  # steps replayed as one CUDA graph (torch; None where not reported)
)


#: what summary.json's ``memory_per_rank`` counts, in bytes, for the rank that holds the most
#: (:class:`~crosstrain.core.run.strategy.CountsMemory`)
MEMORY_PARTS = ("parameters", "gradients", "optimizer")


def largest_rank_memory(
    all_reduce: Any, process_index: int, process_count: int, mine: Mapping[str, int]
) -> dict[str, int]:
    """The :data:`MEMORY_PARTS` of the rank that holds the most of them together (the
    lowest such rank on a tie), on every process: one all-reduce of a [processes, parts]
    array where each process fills its own row."""
    table = np.zeros((process_count, len(MEMORY_PARTS)), np.float64)
    table[process_index] = [mine[part] for part in MEMORY_PARTS]
    table = np.asarray(all_reduce(table))
    largest = int(np.argmax(table.sum(axis=1)))
    return {part: int(value) for part, value in zip(MEMORY_PARTS, table[largest], strict=True)}


def peak_host_memory_bytes() -> int:
    """This process's peak resident memory (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def gather_rank_reports(
    all_reduce: Any, process_index: int, process_count: int, mine: Mapping[str, float | None]
) -> list[dict[str, float | int | None]]:
    """Every process's report, in rank order, on every process: one all-reduce of a
    [processes, fields] array where each process fills its own row (NaN: not measured)."""
    table = np.zeros((process_count, len(RANK_FIELDS)), np.float64)
    table[process_index] = [np.nan if mine.get(name) is None else mine[name] for name in RANK_FIELDS]
    table = np.asarray(all_reduce(table))
    return [
        {"rank": rank}
        | {name: _json_value(name, value) for name, value in zip(RANK_FIELDS, row, strict=True)}
        for rank, row in enumerate(table)
    ]


def _json_value(name: str, value: float) -> float | int | None:
    if np.isnan(value):
        return None
    return int(value) if name.endswith(("_bytes", "_steps")) else round(float(value), 4)


class GpuUtilisation:
    """Samples a GPU's utilisation (percent of time a kernel ran, as NVML reports it) in a
    background thread while training; the mean goes to summary.json. ``read`` is the
    backend's reader for its device (it maps its device index to NVML's); when the first
    read fails (no NVML, no ``pynvml``) nothing is measured and nothing is reported."""

    def __init__(self, read: Callable[[], float], interval_seconds: float = 0.5) -> None:
        self.read, self.interval = read, interval_seconds
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuUtilisation:
        try:
            self.read()
        except Exception:  # any failure means: not measurable here
            return self
        self._thread = threading.Thread(target=self._sample, daemon=True, name="crosstrain-gpu-utilisation")
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """The mean utilisation in percent, or None when nothing was measured."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
        return float(np.mean(self.samples)) if self.samples else None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # one failed sample is left out, not fatal
                self.samples.append(float(self.read()))
