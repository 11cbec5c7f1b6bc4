"""The loop against a minimal numpy backend: losses read in chunks, every step logged in
order, and the steps that ran before a failure logged too."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from crosstrain.core.data.batches import StepBatch
from crosstrain.core.run.job import Job, Layout
from crosstrain.core.run.loop import _named_ahead, train
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.null import NullStrategy
from tests.conftest import MLP_PLAN
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
    return Job(plan=plan, layout=Layout("counting", 1), out_dir=str(tmp_path))


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


class _EpochRecorder:
    """The loop's hooks: every step's (step, epoch, lr) and the step of each evaluation."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []
        self.evaluations: list[int] = []

    def crosstrain_step_end(
        self, context: Any, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
    ) -> None:
        self.steps.append((step, epoch, lr))

    def crosstrain_eval_end(self, context: Any, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        self.evaluations.append(step)

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda **kwargs: None


def _length_job(write_plan: Callable[..., Path], tmp_path: Path, *settings: str) -> Job:
    """The MLP plan without train.epochs (45 steps an epoch), with ``settings``."""
    plan = load_plan(write_plan(MLP_PLAN.replace("epochs = 1\n", "")), ["output.checkpoint=false", *settings])
    return Job(plan=plan, layout=Layout("counting", 1), out_dir=str(tmp_path))


def test_max_steps_without_epochs_runs_exactly_that_many_steps_across_epochs(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """As Lightning's max_steps: 100 steps, through epochs 0, 1 and 2 (45 steps each), each
    epoch evaluated and the last one, cut short, too; a cosine schedule spans the 100 steps."""
    recorder = _EpochRecorder()
    job = _length_job(write_plan, tmp_path, "train.max_steps=100", "schedule.name='cosine'")
    summary, _ = train(CountingStrategy(), job, recorder)  # type: ignore[arg-type]
    assert [step for step, _, _ in recorder.steps] == list(range(1, 101))
    assert [epoch for _, epoch, _ in recorder.steps] == [0] * 45 + [1] * 45 + [2] * 10
    assert recorder.evaluations == [45, 90, 100]
    assert summary["steps"] == 100 and summary["epochs"] == 3
    lr = job.plan.optimizer.lr
    assert recorder.steps[50][2] == pytest.approx(lr / 2)  # step 51: half way down the curve


@pytest.mark.parametrize(("settings", "steps"), [(("train.epochs=1",), 45), (("train.epochs=3",), 100)])
def test_with_epochs_and_max_steps_the_earlier_end_wins(
    write_plan: Callable[..., Path], tmp_path: Path, settings: tuple[str, ...], steps: int
) -> None:
    recorder = _EpochRecorder()
    job = _length_job(write_plan, tmp_path, "train.max_steps=100", *settings)
    summary, _ = train(CountingStrategy(), job, recorder)  # type: ignore[arg-type]
    assert summary["steps"] == steps and [step for step, _, _ in recorder.steps] == list(range(1, steps + 1))
