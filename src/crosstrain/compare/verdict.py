"""The verdict: AGREE, EQUIVALENT, DRIFTED or DIFFERENT, per candidate and as one line
(docs/running.md#compare-agreement-horizon-and-seed-spread).

- AGREE: every candidate's per-step loss within ``tolerance`` (relative) of the reference's
  at every step, its eval loss too, its eval accuracy within ``accuracy_tolerance``;
- otherwise the runs drifted after the *agreement horizon* (the last step up to which every
  candidate agrees). Rounding differences start small and grow as ReLU kinks, max-pool ties,
  batch norm and Adam amplify them, until two runs differ as two seeds do. So a candidate is
  DIFFERENT (likely a bug) when its loss already differs beyond rounding in the first steps
  (``difference.EARLY_STEPS``), or when one of its final eval metrics falls outside where a
  further seed of the reference would land (a 99 % prediction interval from the K+1 seed
  runs); else it is EQUIVALENT. Without seed runs there is no spread to judge by: DRIFTED.

How much rounding shows in the first steps depends on the model (after one Adam step, a
parameter whose gradient is rounding-sized moves by a whole learning rate either way; one
framework's batch norm may round a thousand times more than another's), so the first steps
are judged in fp64: ``compare`` trains each backend's first steps again in fp64 (its *fp64
probe*), where two correct backends agree to within fp64's rounding as this model amplifies
it, and a bug in the arithmetic (a learning rate 5 % off) shows undiminished. A candidate is
DIFFERENT when its fp64 steps 1-2 differ from the reference's by more than the larger of
:data:`FP64_FACTOR` times the model's rounding scaled to fp64 and :data:`FP64_FLOOR`
(:func:`early_bound`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, cast

import attrs

from crosstrain.compare.difference import EARLY_STEPS, Comparison
from crosstrain.compare.spread import SEED_CONFIDENCE, MetricSpread, metric_value, seeds_text
from crosstrain.core.spec.plan import Plan

Kind = Literal["AGREE", "EQUIVALENT", "DRIFTED", "DIFFERENT"]


#: fp32's unit roundoff: the least rounding the first steps are credited with
FP32_UNIT_ROUNDOFF = 2.0**-24
#: fp64's unit roundoff over fp32's: a rounding error of fp32, scaled to fp64
FP64_OVER_FP32 = 2.0**-53 / FP32_UNIT_ROUNDOFF
#: how far beyond the model's rounding scaled to fp64 two backends' fp64 losses may differ
#: in steps 1-2 and still be rounding
FP64_FACTOR = 1e4
#: the least bound: fp32's unit roundoff. A backend training in fp64 may still hold a
#: constant in fp32 (a GELU's, an epsilon), so two correct backends' fp64 losses can differ
#: by more than fp64's rounding; the floor lies decades above that and decades below what
#: a learning rate 5 % off does (the numbers: docs/running.md#how-different-is-decided)
FP64_FLOOR = FP32_UNIT_ROUNDOFF


@attrs.frozen
class Verdict:
    kind: Kind
    #: one per candidate: its own verdict
    per_candidate: Mapping[str, Kind]
    line: str

    @property
    def exit_code(self) -> int:
        return 1 if self.kind == "DIFFERENT" else 0


def probe_plan(plan: Plan) -> Plan | None:
    """The plan of a run's fp64 probe: its first :data:`EARLY_STEPS` steps in fp64, with no
    evaluation (only its step losses are read); None where the plan trains in fp64 already
    (its runs are their own probes)."""
    if plan.train.precision == "fp64":
        return None
    steps = min(plan.train.max_steps or EARLY_STEPS, EARLY_STEPS)
    return without_evaluation(
        attrs.evolve(plan, train=attrs.evolve(plan.train, precision="fp64", max_steps=steps))
    )


def without_evaluation(plan: Plan) -> Plan:
    """``plan`` evaluating never (its steps unchanged): how an fp64 probe runs, and how a
    probe made by hand, which may evaluate, is recognised."""
    train = attrs.evolve(plan.train, eval_every_epochs=0)
    return attrs.evolve(plan, train=train, output=attrs.evolve(plan.output, keep_best=None))


def model_rounding(comparison: Comparison) -> float | None:
    """How far rounding took either run's first steps from their fp64 values (relative):
    this model's amplification of its precision's rounding; None without both probes."""
    rounded = [comparison.reference.own_rounding(), comparison.candidate.own_rounding()]
    known = [value for value in rounded if value is not None]
    return max(known) if len(known) == len(rounded) else None


def credited_rounding(comparison: Comparison) -> float | None:
    """The model's rounding, at least fp32's unit roundoff (runs that trained in fp64 have
    no rounding of their own to measure); None without both probes."""
    rounding = model_rounding(comparison)
    return None if rounding is None else max(rounding, FP32_UNIT_ROUNDOFF)


def early_bound(comparison: Comparison) -> float | None:
    """The largest fp64 steps 1-2 difference rounding explains: :data:`FP64_FACTOR` times
    the model's rounding (at least fp32's unit roundoff) scaled to fp64, and never less
    than :data:`FP64_FLOOR`; None where a run has no fp64 losses (no early check)."""
    rounding = credited_rounding(comparison)
    if rounding is None:
        return None
    return max(FP64_FACTOR * rounding * FP64_OVER_FP32, FP64_FLOOR)


def _early_reason(comparison: Comparison) -> str | None:
    bound, found = early_bound(comparison), comparison.fp64_difference()
    if bound is None or found is None or found[1] <= bound:
        return None
    step, difference = found
    return (
        f"{comparison.candidate.name}'s step-{step} loss in fp64 differs from "
        f"{comparison.reference.name}'s by {difference:.1e} (relative), beyond what rounding "
        f"and fp32 constants explain ({bound:.1e}) so soon after the start"
    )


def unjudged_text(comparisons: Sequence[Comparison]) -> str:
    """What the line adds where a run's first steps could not be judged: which run lacks
    its fp64 probe."""
    missing = sorted(
        {
            run.name
            for comparison in comparisons
            for run in (comparison.reference, comparison.candidate)
            if run.fp64_losses() is None
        }
    )
    if not missing:
        return ""
    return (
        f"; steps 1-{EARLY_STEPS} not judged: no fp64 probe of {', '.join(missing)} "
        f"(crosstrain compare PLAN runs them)"
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
    accuracy_tolerance: float,
) -> tuple[Kind, list[str]]:
    """One candidate's verdict and the reasons (DIFFERENT) or the numbers (EQUIVALENT)."""
    name, reference = comparison.candidate.name, comparison.reference.name
    if not comparison.same_steps:
        steps = (len(comparison.candidate.losses), len(comparison.reference.losses))
        return "DIFFERENT", [f"{name} ran {steps[0]} steps, {reference} {steps[1]}"]
    if comparison.agrees(accuracy_tolerance):
        return "AGREE", []
    early = _early_reason(comparison)
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
    accuracy_tolerance: float,
) -> Verdict:
    """The verdict of every candidate against the reference, as one line."""
    seed_label = seeds_text(seeds)
    judged = {
        c.candidate.name: judge_candidate(c, spreads, seed_label, accuracy_tolerance) for c in comparisons
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
        return Verdict("DRIFTED", kinds, line + unjudged_text(comparisons))
    if "EQUIVALENT" in kinds.values():
        numbers = [text for kind, found in judged.values() if kind == "EQUIVALENT" for text in found]
        line = (
            f"verdict: EQUIVALENT: {_within_text(tolerance, horizon)} ({_drift_text(comparisons)}), "
            f"then within the seed spread: " + "; ".join(numbers)
        )
        return Verdict("EQUIVALENT", kinds, line + unjudged_text(comparisons))
    steps = comparisons[0].steps
    line = (
        f"verdict: AGREE: every step's loss within {tolerance:g} (relative) for all {steps} steps, "
        f"eval loss within {tolerance:g}, eval accuracy within {accuracy_tolerance:g}"
    )
    return Verdict("AGREE", kinds, line)
