"""How a candidate run's losses differ from the reference's, step by step and at the end:
the relative difference per step, the agreement horizon and how fast the difference grows
after it, and how their first steps differ in fp64 (pure numpy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

#: the steps whose loss difference must be rounding-sized for a drift to be rounding's:
#: step 1's loss is the initial weights' forward, step 2's the first after an update
EARLY_STEPS = 2
#: how many steps after the horizon the table shows the difference at (log-spaced)
GROWTH_POINTS = 4


@attrs.frozen
class BackendRun:
    """A finished run: its summary and per-step losses. ``label`` names it in the table
    (default: its backend)."""

    backend: str
    summary: Mapping[str, Any]
    losses: np.ndarray
    seed: int = 0
    label: str = ""
    #: its first :data:`EARLY_STEPS` losses trained again in fp64 (its *fp64 probe*); None
    #: where no probe ran
    probe: np.ndarray | None = None

    @property
    def name(self) -> str:
        return self.label or self.backend

    @property
    def precision(self) -> str:
        return str(self.summary.get("precision", "fp32"))

    def fp64_losses(self) -> np.ndarray | None:
        """Its first steps' losses in fp64: its own where it trained in fp64, else its
        probe's (None where it has none)."""
        if self.precision == "fp64":
            return self.losses[:EARLY_STEPS]
        return None if self.probe is None else self.probe[:EARLY_STEPS]

    def own_rounding(self) -> float | None:
        """How far its first steps' losses lie from their fp64 values (relative): what its
        precision's rounding grew to on this model; None without a probe."""
        exact = self.fp64_losses()
        if exact is None:
            return None
        return _largest(step_relative_differences(exact, self.losses[: len(exact)]))


@attrs.frozen
class ComparedRuns:
    reference: BackendRun
    candidates: tuple[BackendRun, ...]
    seed_runs: tuple[BackendRun, ...] = ()


@attrs.frozen
class Comparison:
    """How a candidate run differs from the reference, step by step and at the end."""

    reference: BackendRun
    candidate: BackendRun
    #: |candidate - reference| / |reference| per step (step s at index s-1); inf where one
    #: loss is not finite. Empty when the step counts differ.
    relative: np.ndarray
    tolerance: float
    eval_relative_loss_difference: float
    accuracy_difference: float

    @property
    def same_steps(self) -> bool:
        return len(self.reference.losses) == len(self.candidate.losses)

    @property
    def steps(self) -> int:
        return len(self.relative)

    @property
    def horizon(self) -> int:
        """The last step up to which every step's loss is within the tolerance (0: none)."""
        beyond = np.flatnonzero(self.relative > self.tolerance)
        return int(beyond[0]) if beyond.size else self.steps

    @property
    def leaves_at(self) -> int | None:
        """The first step beyond the tolerance; None when every step is within it."""
        return self.horizon + 1 if self.horizon < self.steps else None

    @property
    def max_relative_loss_difference(self) -> float:
        return float(self.relative.max()) if self.relative.size else float("inf")

    @property
    def worst_step(self) -> int:
        return int(np.argmax(self.relative)) + 1 if self.relative.size else 0

    def early_difference(self) -> tuple[int, float]:
        """The largest difference of the first :data:`EARLY_STEPS` steps, and its step."""
        early = self.relative[:EARLY_STEPS]
        if not early.size:
            return 0, 0.0
        return int(np.argmax(early)) + 1, float(early.max())

    def fp64_difference(self) -> tuple[int, float] | None:
        """The largest relative difference of the candidate's first steps in fp64 from the
        reference's, and its step; None where either has no fp64 losses."""
        reference, candidate = self.reference.fp64_losses(), self.candidate.fp64_losses()
        if reference is None or candidate is None:
            return None
        if reference.shape != candidate.shape:  # a probe that ran fewer steps than its twin
            return 0, float("inf")
        relative = step_relative_differences(reference, candidate)
        if not relative.size:
            return 0, 0.0
        return int(np.argmax(relative)) + 1, float(relative.max())

    def growth(self, points: int = GROWTH_POINTS) -> list[tuple[int, float]]:
        """The difference from the first step beyond the tolerance to the last, at
        ``points`` log-spaced steps: how fast it grows (orders of magnitude per decade)."""
        if self.leaves_at is None:
            return []
        steps = np.unique(np.geomspace(self.leaves_at, self.steps, points).round().astype(int))
        return [(int(step), float(self.relative[step - 1])) for step in steps]

    def agrees(self, accuracy_tolerance: float) -> bool:
        return (
            self.same_steps
            and self.leaves_at is None
            and self.eval_relative_loss_difference <= self.tolerance
            and self.accuracy_difference <= accuracy_tolerance
        )


def _largest(relative: np.ndarray) -> float:
    return float(relative.max()) if relative.size else 0.0


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def step_relative_differences(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per step |candidate - reference| / |reference|; inf where either is not finite."""
    if reference.shape != candidate.shape:
        return np.zeros(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = np.abs(candidate - reference) / np.maximum(np.abs(reference), 1e-12)
    return np.where(np.isfinite(reference) & np.isfinite(candidate), relative, np.inf)


def compare_pair(reference: BackendRun, candidate: BackendRun, tolerance: float = 1e-4) -> Comparison:
    reference_eval, candidate_eval = reference.summary.get("eval", {}), candidate.summary.get("eval", {})
    eval_difference = (
        _relative(candidate_eval["loss"], reference_eval["loss"])
        if "loss" in reference_eval and "loss" in candidate_eval
        else 0.0
    )
    accuracy_difference = abs(candidate_eval.get("accuracy", 0.0) - reference_eval.get("accuracy", 0.0))
    relative = step_relative_differences(reference.losses, candidate.losses)
    return Comparison(reference, candidate, relative, tolerance, eval_difference, accuracy_difference)


def comparisons_of(runs: ComparedRuns, tolerance: float) -> list[Comparison]:
    return [compare_pair(runs.reference, candidate, tolerance) for candidate in runs.candidates]
