"""The seed spread: where a further seed of the reference backend would land, from the
final metrics of the reference and its seed runs (a Student's t prediction interval)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs
import numpy as np

from crosstrain.compare.difference import BackendRun

#: how sure a DIFFERENT must be: a candidate that drifts as far as another seed would is
#: called DIFFERENT with at most this probability (for normally spread metrics)
SEED_CONFIDENCE = 0.99
#: the final metrics judged against the seed spread, as (label, summary section, key)
SPREAD_METRICS = (("eval loss", "eval", "loss"), ("eval accuracy", "eval", "accuracy"))
#: what is judged where a plan has no eval set (``data.eval_fraction = 0``)
NO_EVAL_SPREAD_METRICS = (("final train loss", "train", "loss"),)
#: the values a metric can take: the interval is cut to them (a loss is never negative, an
#: accuracy never above 1)
METRIC_RANGES: dict[str, tuple[float, float]] = {"loss": (0.0, float("inf")), "accuracy": (0.0, 1.0)}


def metric_value(summary: Mapping[str, Any], section: str, key: str) -> float | None:
    value = (summary.get(section) or {}).get(key)
    return None if value is None else float(value)


@attrs.frozen
class MetricSpread:
    """One final metric over the reference backend's seed runs (the reference's own seed
    first): where a further seed lands."""

    label: str
    section: str
    key: str
    values: tuple[float, ...]
    #: the smallest difference the metric can show (accuracy: one eval example)
    resolution: float = 0.0

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        return self.high - self.low

    def interval(self, confidence: float = SEED_CONFIDENCE) -> tuple[float, float]:
        """The prediction interval of one more seed: mean +- t * s * sqrt(1 + 1/n), with
        Student's t at n - 1 degrees of freedom (n runs, sample deviation s), widened to
        the metric's resolution and cut to the values it can take."""
        from scipy import stats  # here: only a seed spread needs it, and it is slow to import

        values = np.array(self.values)
        quantile = float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1))
        half = quantile * float(values.std(ddof=1)) * float(np.sqrt(1 + 1 / len(values)))
        half = max(half, self.resolution)
        lowest, highest = METRIC_RANGES.get(self.key, (-float("inf"), float("inf")))
        return max(float(values.mean()) - half, lowest), min(float(values.mean()) + half, highest)

    def holds(self, value: float) -> bool:
        low, high = self.interval()
        return low <= value <= high


def seed_spreads(reference: BackendRun, seed_runs: Sequence[BackendRun]) -> list[MetricSpread]:
    """The spread of each of :data:`SPREAD_METRICS` the reference reports (of
    :data:`NO_EVAL_SPREAD_METRICS` where it reports none: no eval set), over the reference
    and its seed runs; none without seed runs."""
    if not seed_runs:
        return []
    runs = [reference, *seed_runs]
    has_eval = any(
        metric_value(reference.summary, section, key) is not None for _, section, key in SPREAD_METRICS
    )
    spreads = []
    for label, section, key in SPREAD_METRICS if has_eval else NO_EVAL_SPREAD_METRICS:
        values = [metric_value(run.summary, section, key) for run in runs]
        if any(value is None for value in values):
            continue
        count = metric_value(reference.summary, section, "count")
        resolution = 1.0 / count if key == "accuracy" and count else 0.0
        spreads.append(MetricSpread(label, section, key, tuple(cast(list[float], values)), resolution))
    return spreads


def seeds_text(seeds: Sequence[int]) -> str:
    """0..3 for consecutive seeds, else 0, 4, 9."""
    ordered = sorted(seeds)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return ", ".join(map(str, ordered))
