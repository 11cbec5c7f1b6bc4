"""The bookkeeping of rows a backend reads ahead in the background: each step's work found
again by the batch it was started for, and a deadline on the wait for it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Generic, TypeVar

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
