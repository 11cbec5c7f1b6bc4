"""The loop against a minimal numpy backend: losses read in chunks, every step logged in
order, and the steps that ran before a failure logged too."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from crosstrain.core.data import StepBatch
from crosstrain.core.loop import _named_ahead, train
from crosstrain.core.planfile import load_plan
from crosstrain.core.strategy import Job
from crosstrain.testing.null import NullStrategy
from tests.support import StepRecorder


class CountingStrategy(NullStrategy):
    """Returns the step number as the loss; fails at ``fail_at`` if set."""

    name = "counting"

    def __init__(self, fail_at: int | None = None, resolves: bool = False) -> None:
        super().__init__()
        self.fail_at, self.chunks = fail_at, []
        if resolves:
            self.resolve_metrics = self._resolve  # the optional capability, per instance

    def train_step(self, state: Any, step: StepBatch, lr: float) -> dict[str, Any]:
        assert step.micro_batches[0].source is not None  # index batches: rows not gathered
        if step.step + 1 == self.fail_at:
            raise RuntimeError(f"failed at step {self.fail_at}")
        return super().train_step(state, step, lr)

    def _resolve(self, pending: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        self.chunks.append(len(pending))
        return [{name: float(value) for name, value in metrics.items()} for metrics in pending]


def _job(write_plan: Callable[..., Path], tmp_path: Path, every: int) -> Job:
    plan = load_plan(
        write_plan(), [f"output.log_every_steps={every}", "train.max_steps=12", "output.checkpoint=false"]
    )
    return Job(plan=plan, backend="counting", out_dir=str(tmp_path))


@pytest.mark.parametrize("resolves", [False, True])
def test_every_step_is_logged_in_order_from_chunked_reads(
    write_plan: Callable[..., Path], tmp_path: Path, resolves: bool
) -> None:
    recorder, strategy = StepRecorder(), CountingStrategy(resolves=resolves)
    summary, _ = train(strategy, _job(write_plan, tmp_path, every=5), recorder)  # type: ignore[arg-type]
    assert recorder.steps == [(step, float(step)) for step in range(1, 13)]
    assert summary["steps"] == 12
    if resolves:
        assert strategy.chunks == [5, 5, 2]  # every 5 steps, and what is left at the end


def test_the_steps_that_ran_before_a_failure_are_logged(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    recorder = StepRecorder()
    with pytest.raises(RuntimeError, match="failed at step 8"):
        train(CountingStrategy(fail_at=8), _job(write_plan, tmp_path, every=5), recorder)  # type: ignore[arg-type]
    assert [step for step, _ in recorder.steps] == [1, 2, 3, 4, 5, 6, 7]


def test_the_loop_names_each_step_ahead_once_the_first_with_the_two_after_it() -> None:
    assert list(_named_ahead(iter(range(5)), 2)) == [(0, [0, 1, 2]), (1, [3]), (2, [4]), (3, []), (4, [])]
    assert list(_named_ahead(iter(range(2)), 2)) == [(0, [0, 1]), (1, [])]
    assert list(_named_ahead(iter(()), 2)) == []
