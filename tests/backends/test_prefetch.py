"""What every backend's prefetching shares: work found again by the batch it was started
for, and a deadline on the wait for it."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from crosstrain.backends.prefetch import Prefetched


def test_a_batch_finds_the_work_started_for_it_once() -> None:
    prefetched: Prefetched[str] = Prefetched()
    named, other = object(), object()
    with ThreadPoolExecutor(1) as pool:
        prefetched.put(named, pool.submit(lambda: "rows"))
        assert prefetched.take(other) is None  # never named: read in the step
        assert prefetched.take(named) == "rows"
        assert prefetched.take(named) is None  # taken already
    assert prefetched.taken == 1


def test_a_read_that_never_ends_fails_the_step_at_the_deadline() -> None:
    prefetched: Prefetched[str] = Prefetched(timeout_seconds=0.05)
    batch, never = object(), Future[str]()
    prefetched.put(batch, never)
    with pytest.raises(TimeoutError, match=r"reading a batch's rows took more than 0\.05 s"):
        prefetched.settle()
    with pytest.raises(TimeoutError):
        prefetched.take(batch)


def test_a_failed_read_fails_the_step_that_takes_it() -> None:
    prefetched: Prefetched[str] = Prefetched()
    batch, failed = object(), Future[str]()
    failed.set_exception(OSError("images.npy: input/output error"))
    prefetched.put(batch, failed)
    with pytest.raises(OSError, match=r"images\.npy"):
        prefetched.take(batch)


def test_settle_waits_for_every_read_started() -> None:
    prefetched: Prefetched[int] = Prefetched()
    release, done = threading.Event(), []

    def read(value: int) -> int:
        release.wait(5)
        done.append(value)
        return value

    with ThreadPoolExecutor(2) as pool:
        for value in (1, 2):
            prefetched.put(object(), pool.submit(read, value))
        release.set()
        prefetched.settle()
        assert sorted(done) == [1, 2]
