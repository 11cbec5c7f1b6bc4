"""summary.json's per-rank reports: gathered in rank order, NaN as "not measured"."""

from __future__ import annotations

import threading

import numpy as np

from crosstrain.core.run.rank_usage import (
    RANK_FIELDS,
    GpuUtilisation,
    gather_rank_reports,
    peak_host_memory_bytes,
)


def test_every_rank_fills_its_own_row_and_unmeasured_fields_are_none() -> None:
    rows: list[np.ndarray] = []
    barrier = threading.Barrier(2)

    def all_reduce(table: np.ndarray) -> np.ndarray:  # two "processes" summing their tables
        rows.append(table)
        barrier.wait(timeout=5)
        return np.sum(rows, axis=0)

    results: dict[int, list[dict[str, float | int | None]]] = {}

    def rank(index: int) -> None:
        mine = {"data_seconds": 0.5 + index, "step_seconds": 2.0, "peak_host_memory_bytes": 1e9 + index}
        results[index] = gather_rank_reports(all_reduce, index, 2, mine)

    threads = [threading.Thread(target=rank, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results[0] == results[1]
    assert [report["rank"] for report in results[0]] == [0, 1]
    assert results[0][1]["data_seconds"] == 1.5 and results[0][1]["peak_host_memory_bytes"] == 1_000_000_001
    assert results[0][0]["peak_device_memory_bytes"] is None and set(RANK_FIELDS) < set(results[0][0])


def test_peak_host_memory_is_this_process_resident_peak() -> None:
    assert 10 * 2**20 < peak_host_memory_bytes() < 64 * 2**30


def test_utilisation_is_the_mean_of_samples_and_none_when_unreadable() -> None:
    readings = iter([0.0, 40.0, 60.0] + [50.0] * 1000)
    sampler = GpuUtilisation(lambda: next(readings), interval_seconds=0.01).start()
    threading.Event().wait(0.1)
    mean = sampler.stop()
    assert mean is not None and 40.0 <= mean <= 60.0

    def broken() -> float:
        raise ModuleNotFoundError("pynvml")

    assert GpuUtilisation(broken, interval_seconds=0.01).start().stop() is None
