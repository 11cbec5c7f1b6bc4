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
parameter whose gradient is rounding-sized moves by a whole learning rate either way), so
the early bound is measured on the model at hand: ``compare`` runs the reference's first
steps again at another world size (the *rounding probe*: the same arithmetic, every
reduction in another order); the reference's own rounding is its loss against the
probe's, and a candidate is DIFFERENT only beyond :data:`ROUNDING_FACTOR` times it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, cast

import attrs

from crosstrain.compare.difference import EARLY_STEPS, BackendRun, ComparedRuns, Comparison, rounding_floor
from crosstrain.compare.spread import SEED_CONFIDENCE, MetricSpread, metric_value, seeds_text
from crosstrain.core.errors import CrosstrainError
from crosstrain.core.plan import Plan

Kind = Literal["AGREE", "EQUIVALENT", "DRIFTED", "DIFFERENT"]


#: the precisions whose first steps are judged against the reference's own rounding, and
#: the smallest rounding counted in each: its unit roundoff (a probe may happen to round
#: to almost nothing in its first steps). bf16 (4e-4 to 7e-4 in steps 1-2) and fp16 (unit
#: roundoff 5e-4) round as much as a 10 % learning-rate bug shows: no early check, the
#: seed spread alone judges them.
UNIT_ROUNDOFF: dict[str, float] = {"fp32": 2.0**-24, "fp64": 2.0**-53}
#: every precision compare knows: with an early check (above) or without
KNOWN_PRECISIONS = ("fp32", "fp64", "bf16", "fp16")
#: how far beyond the reference's own rounding a candidate's steps 1-2 may differ; a
#: correct candidate rounds differently, not more, so its difference stays within a few
#: times the probe's. The choice, and the rates it gives, are measured in
#: benchmarks/compare_rounding.py (docs/running.md#how-different-is-decided).
ROUNDING_FACTOR = 30.0


@attrs.frozen
class Verdict:
    kind: Kind
    #: one per candidate: its own verdict
    per_candidate: Mapping[str, Kind]
    line: str

    @property
    def exit_code(self) -> int:
        return 1 if self.kind == "DIFFERENT" else 0


def is_probed(precision: str) -> bool:
    """Whether the first steps of a ``precision`` run are judged (by a rounding probe)."""
    if precision not in KNOWN_PRECISIONS:
        raise CrosstrainError(
            f"train.precision {precision!r}: compare knows no rounding for it "
            f"(known: {', '.join(KNOWN_PRECISIONS)})"
        )
    return precision in UNIT_ROUNDOFF


def early_bound(precision: str, rounding: float | None) -> float | None:
    """The largest steps 1-2 difference rounding explains, given the reference's own
    rounding (the probe's measure; None where no probe ran); None: no early check."""
    if not is_probed(precision) or rounding is None:
        return None
    return ROUNDING_FACTOR * max(rounding, UNIT_ROUNDOFF[precision])


def probe_world(replicas: int) -> int:
    """The world the rounding probe runs at: another than the reference's, so that every
    reduction (the gradients' all-reduce, the loss's and batch norm's sums) adds its terms
    in another order, while the arithmetic stays the same."""
    return 2 if replicas == 1 else 1


def rounding_probe_plan(plan: Plan) -> Plan | None:
    """The plan of the reference's rounding probe: its first :data:`EARLY_STEPS` steps;
    None where its precision has no early check."""
    if not is_probed(plan.train.precision):
        return None
    steps = min(plan.train.max_steps or EARLY_STEPS, EARLY_STEPS)
    return attrs.evolve(plan, train=attrs.evolve(plan.train, max_steps=steps))


@attrs.frozen
class Rounding:
    """What the first steps of a comparison are judged by: the reference's own rounding,
    the largest relative difference of its steps 1-2 from its probe's (None where no probe
    ran), the bound it gives (None: no early check) and the worlds it came from."""

    precision: str
    measured: float | None
    bound: float | None
    worlds: tuple[int, int] = (1, 2)

    @property
    def unprobed(self) -> bool:
        """An early check was due, but no rounding probe is among the runs."""
        return self.bound is None and is_probed(self.precision)


def _world(run: BackendRun) -> int:
    return int(run.summary.get("world_size", 1))


def rounding_of(runs: ComparedRuns) -> Rounding:
    precision = str(runs.reference.summary.get("precision", "fp32"))
    if runs.rounding is None:
        return Rounding(precision, None, early_bound(precision, None))
    measured = rounding_floor(runs.reference, runs.rounding)
    worlds = (_world(runs.reference), _world(runs.rounding))
    return Rounding(precision, measured, early_bound(precision, measured), worlds)


def _early_reason(comparison: Comparison, rounding: Rounding) -> str | None:
    step, difference = comparison.early_difference()
    if rounding.bound is None or difference <= rounding.bound:
        return None
    reference = comparison.reference.name
    ours, probe = rounding.worlds
    beyond = (
        f"over {ROUNDING_FACTOR:g}x {reference}'s own rounding ({rounding.measured:.1e}: its "
        f"steps 1-{EARLY_STEPS} at x{ours} against x{probe})"
    )
    return (
        f"{comparison.candidate.name}'s step-{step} loss differs from {reference}'s "
        f"by {difference:.1e} (relative), {beyond} so soon after the start"
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
    rounding: Rounding,
    accuracy_tolerance: float,
) -> tuple[Kind, list[str]]:
    """One candidate's verdict and the reasons (DIFFERENT) or the numbers (EQUIVALENT)."""
    name, reference = comparison.candidate.name, comparison.reference.name
    if not comparison.same_steps:
        steps = (len(comparison.candidate.losses), len(comparison.reference.losses))
        return "DIFFERENT", [f"{name} ran {steps[0]} steps, {reference} {steps[1]}"]
    if comparison.agrees(accuracy_tolerance):
        return "AGREE", []
    early = _early_reason(comparison, rounding)
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


def _unprobed_text(rounding: Rounding) -> str:
    if not rounding.unprobed:
        return ""
    return (
        f"; steps 1-{EARLY_STEPS} not judged: no rounding probe among the runs "
        f"(crosstrain compare PLAN runs one)"
    )


def _within_text(tolerance: float, horizon: int) -> str:
    if horizon == 0:
        return f"beyond {tolerance:g} from step 1"
    return f"every step within {tolerance:g} up to step {horizon}"


def judge(
    comparisons: Sequence[Comparison],
    spreads: Sequence[MetricSpread],
    seeds: Sequence[int],
    rounding: Rounding,
    accuracy_tolerance: float,
) -> Verdict:
    """The verdict of every candidate against the reference, as one line."""
    seed_label = seeds_text(seeds)
    judged = {
        c.candidate.name: judge_candidate(c, spreads, seed_label, rounding, accuracy_tolerance)
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
        return Verdict("DRIFTED", kinds, line + _unprobed_text(rounding))
    if "EQUIVALENT" in kinds.values():
        numbers = [text for kind, found in judged.values() if kind == "EQUIVALENT" for text in found]
        line = (
            f"verdict: EQUIVALENT: {_within_text(tolerance, horizon)} ({_drift_text(comparisons)}), "
            f"then within the seed spread: " + "; ".join(numbers)
        )
        return Verdict("EQUIVALENT", kinds, line + _unprobed_text(rounding))
    steps = comparisons[0].steps
    line = (
        f"verdict: AGREE: every step's loss within {tolerance:g} (relative) for all {steps} steps, "
        f"eval loss within {tolerance:g}, eval accuracy within {accuracy_tolerance:g}"
    )
    return Verdict("AGREE", kinds, line)
