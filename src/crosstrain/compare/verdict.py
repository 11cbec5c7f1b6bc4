"""The verdict: AGREE, EQUIVALENT, DRIFTED or DIFFERENT, per candidate and as one line
(docs/running.md#compare-agreement-horizon-and-seed-spread).

- AGREE: every candidate's per-step loss within ``tolerance`` (relative) of the reference's
  at every step, its eval loss too, its eval accuracy within ``accuracy_tolerance``;
- otherwise the runs drifted after the *agreement horizon* (the last step up to which every
  candidate agrees). Rounding differences (1e-7 in fp32) start small and grow as ReLU kinks,
  max-pool ties, batch norm and Adam amplify them, until two runs differ as two seeds do.
  So a candidate is DIFFERENT (likely a bug) when its loss already differs beyond rounding
  in the first steps (``difference.EARLY_STEPS``, :data:`ROUNDING_BOUNDS`), or when one of its
  final eval metrics falls outside where a further seed of the reference would land (a 99 %
  prediction interval from the K+1 seed runs); else it is EQUIVALENT. Without seed runs
  there is no spread to judge by: DRIFTED.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, cast

import attrs

from crosstrain.compare.difference import Comparison
from crosstrain.compare.spread import SEED_CONFIDENCE, MetricSpread, metric_value, seeds_text
from crosstrain.core.errors import CrosstrainError

Kind = Literal["AGREE", "EQUIVALENT", "DRIFTED", "DIFFERENT"]

#: the largest relative step-loss difference rounding makes in the first
#: ``difference.EARLY_STEPS`` steps, by ``train.precision``. fp32: measured up to 1.9e-7
#: (docs/running.md), a learning rate 10 % off 1.4e-3 to 1.5e-2; the bound sits 50x above
#: the one and 100x below the other. fp64: not measured; its rounding is 5e8x finer than
#: fp32's, the bound only 1e5x. bf16 (measured 4e-4 to 7e-4) and fp16 (unit roundoff 5e-4)
#: round as much as such a bug: no early check (None), the seed spread alone judges.
ROUNDING_BOUNDS: dict[str, float | None] = {"fp64": 1e-10, "fp32": 1e-5, "bf16": None, "fp16": None}


@attrs.frozen
class Verdict:
    kind: Kind
    #: one per candidate: its own verdict
    per_candidate: Mapping[str, Kind]
    line: str

    @property
    def exit_code(self) -> int:
        return 1 if self.kind == "DIFFERENT" else 0


def rounding_bound(precision: str) -> float | None:
    if precision not in ROUNDING_BOUNDS:
        raise CrosstrainError(
            f"train.precision {precision!r}: compare knows no rounding bound for it "
            f"(known: {', '.join(ROUNDING_BOUNDS)})"
        )
    return ROUNDING_BOUNDS[precision]


def _early_reason(comparison: Comparison, precision: str) -> str | None:
    bound = rounding_bound(precision)
    step, difference = comparison.early_difference()
    if bound is None or difference <= bound:
        return None
    return (
        f"{comparison.candidate.name}'s step-{step} loss differs from {comparison.reference.name}'s "
        f"by {difference:.1e} (relative), beyond rounding ({bound:g} in {precision}) so soon after the start"
    )


def _spread_text(comparison: Comparison, spread: MetricSpread, seeds: str) -> str:
    """The candidate's metric against the reference's and the seeds': the numbers a user
    checks an EQUIVALENT or a DIFFERENT by."""
    value = cast(float, metric_value(comparison.candidate.summary, spread.section, spread.key))
    reference = spread.values[0]
    low, high = spread.interval()
    where = "another seed lands in" if spread.holds(value) else "outside where another seed lands,"
    return (
        f"{comparison.candidate.name}'s {spread.label} {value:.4f} differs from "
        f"{comparison.reference.name}'s {reference:.4f} by {abs(value - reference):.4f}; "
        f"seeds {seeds} spread {spread.low:.4f}..{spread.high:.4f} ({spread.spread:.4f}), "
        f"{where} {low:.4f}..{high:.4f} ({SEED_CONFIDENCE:.0%})"
    )


def judge_candidate(
    comparison: Comparison,
    spreads: Sequence[MetricSpread],
    seeds: str,
    precision: str,
    accuracy_tolerance: float,
) -> tuple[Kind, list[str]]:
    """One candidate's verdict and the reasons (DIFFERENT) or the numbers (EQUIVALENT)."""
    name, reference = comparison.candidate.name, comparison.reference.name
    if not comparison.same_steps:
        steps = (len(comparison.candidate.losses), len(comparison.reference.losses))
        return "DIFFERENT", [f"{name} ran {steps[0]} steps, {reference} {steps[1]}"]
    if comparison.agrees(accuracy_tolerance):
        return "AGREE", []
    early = _early_reason(comparison, precision)
    if early is not None:
        return "DIFFERENT", [early]
    if not spreads:
        return "DRIFTED", []
    candidate = comparison.candidate.summary
    values = [metric_value(candidate, spread.section, spread.key) for spread in spreads]
    missing = [
        f"{name} reports no {spread.label}"
        for spread, value in zip(spreads, values, strict=True)
        if value is None
    ]
    if missing:
        return "DIFFERENT", missing
    outside = [
        _spread_text(comparison, spread, seeds)
        for spread, value in zip(spreads, values, strict=True)
        if not spread.holds(cast(float, value))
    ]
    if outside:
        return "DIFFERENT", outside
    return "EQUIVALENT", [_spread_text(comparison, spread, seeds) for spread in spreads]


def _drift_text(comparisons: Sequence[Comparison]) -> str:
    """Where the first candidate to leave the tolerance leaves it, and how far it gets."""
    leaving = [c for c in comparisons if c.leaves_at is not None]
    if not leaving:  # every step agrees, an eval metric does not
        first = comparisons[0]
        return (
            f"every step within {first.tolerance:g}, but {first.candidate.name}'s eval loss differs "
            f"by {first.eval_relative_loss_difference:.1e}, its eval accuracy by "
            f"{first.accuracy_difference:.4f}"
        )
    first = min(leaving, key=lambda c: c.horizon)
    return (
        f"{first.candidate.name} leaves {first.tolerance:g} at step {first.leaves_at}, "
        f"{first.max_relative_loss_difference:.1e} by step {first.worst_step}"
    )


def _within_text(tolerance: float, horizon: int) -> str:
    if horizon == 0:
        return f"beyond {tolerance:g} from step 1"
    return f"every step within {tolerance:g} up to step {horizon}"


def judge(
    comparisons: Sequence[Comparison],
    spreads: Sequence[MetricSpread],
    seeds: Sequence[int],
    precision: str,
    accuracy_tolerance: float,
) -> Verdict:
    """The verdict of every candidate against the reference, as one line."""
    seed_label = seeds_text(seeds)
    judged = {
        c.candidate.name: judge_candidate(c, spreads, seed_label, precision, accuracy_tolerance)
        for c in comparisons
    }
    kinds = {name: kind for name, (kind, _) in judged.items()}
    horizon = min(c.horizon for c in comparisons)
    tolerance = comparisons[0].tolerance
    if "DIFFERENT" in kinds.values():
        reasons = [reason for kind, found in judged.values() if kind == "DIFFERENT" for reason in found]
        return Verdict("DIFFERENT", kinds, "verdict: DIFFERENT (likely a bug): " + "; ".join(reasons))
    if "DRIFTED" in kinds.values():
        line = (
            f"verdict: DRIFTED {'after step ' + str(horizon) if horizon else 'from step 1'} "
            f"({_drift_text(comparisons)}); "
            f"no seed spread to judge it by: --seeds 3 tells EQUIVALENT from DIFFERENT"
        )
        return Verdict("DRIFTED", kinds, line)
    if "EQUIVALENT" in kinds.values():
        numbers = [text for kind, found in judged.values() if kind == "EQUIVALENT" for text in found]
        line = (
            f"verdict: EQUIVALENT: {_within_text(tolerance, horizon)} ({_drift_text(comparisons)}), "
            f"then within the seed spread: " + "; ".join(numbers)
        )
        return Verdict("EQUIVALENT", kinds, line)
    steps = comparisons[0].steps
    line = (
        f"verdict: AGREE: every step's loss within {tolerance:g} (relative) for all {steps} steps, "
        f"eval loss within {tolerance:g}, eval accuracy within {accuracy_tolerance:g}"
    )
    return Verdict("AGREE", kinds, line)
