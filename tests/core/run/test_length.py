"""A run's length: ``train.max_steps`` without ``train.epochs`` runs exactly that many steps
across epochs; with both the earlier end wins; the header names what ends the run; what
continues a finished run is only a change that moves its end."""

from __future__ import annotations

import pytest

from crosstrain.core.run.length import RunLength


@pytest.mark.parametrize(
    ("epochs", "max_steps", "steps", "described"),
    [
        (None, None, 63, "63 steps (1 epoch)"),  # neither: one epoch
        (2, None, 126, "126 steps (2 epochs)"),
        (None, 150, 150, "150 steps (max_steps; 2.4 epochs)"),  # epochs unbounded
        (None, 126, 126, "126 steps (max_steps; 2 epochs)"),
        (3, 150, 150, "150 steps (max_steps; 2.4 epochs)"),  # max_steps comes first
        (1, 150, 63, "63 steps (1 epoch; max_steps 150 not reached)"),  # the epochs come first
        (2, 126, 126, "126 steps (2 epochs)"),  # both end at one step
        (None, 1, 1, "1 step (max_steps; 0.02 epochs)"),
    ],
)
def test_max_steps_without_epochs_runs_exactly_that_many_steps_and_the_earlier_end_wins(
    epochs: int | None, max_steps: int | None, steps: int, described: str
) -> None:
    length = RunLength(steps_per_epoch=63, epochs=epochs, max_steps=max_steps)
    assert length.total_steps == steps
    assert length.describe() == described


def test_the_hint_to_continue_names_only_what_ends_the_run() -> None:
    """Raising a field that does not end the run would change nothing: it is never offered."""
    by_epochs = RunLength(63, epochs=1, max_steps=150)
    assert by_epochs.reason() == "train.epochs = 1"
    assert by_epochs.extension_hint() == "--set train.epochs=N continues it to a new end"
    by_max_steps = RunLength(63, epochs=3, max_steps=150)
    assert by_max_steps.extension_hint() == "--set train.max_steps=N continues it to a new end"
    both = RunLength(63, epochs=2, max_steps=126)
    assert both.reason() == "train.epochs = 2 and train.max_steps = 126"
    assert "train.epochs=N and train.max_steps=M" in both.extension_hint()
    neither = RunLength(63)  # max_steps alone, epochs then unbounded, moves the end too
    assert neither.extension_hint() == "--set train.epochs=N or train.max_steps=N continues it to a new end"


def test_an_empty_epoch_ends_an_unbounded_run_at_once() -> None:
    """No training rows: no steps, not an endless loop over empty epochs."""
    assert RunLength(0, max_steps=100).total_steps == 0
