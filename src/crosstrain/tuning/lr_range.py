"""The learning-rate range test: from the plan's initial weights, the rate rises
exponentially from ``min_lr`` to ``max_lr`` over ``steps`` steps (``schedule.name =
"exponential"``) and the run stops once the loss diverges; the suggestion is the rate
where the smoothed loss falls fastest (Lightning's ``lr_find`` rule, and fastai's)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from crosstrain.core.errors import InputError
from crosstrain.plugins.metrics import read_metrics
from crosstrain.tuning.divergence import SmoothedLoss

#: the first steps and the last one are left out of the suggestion: the moving average is
#: still filling at the start, and the last step is where it diverged
SKIP_BEGIN, SKIP_END = 10, 1
PLOT_FILE = "lr_range.png"


@attrs.frozen
class RangeTest:
    min_lr: float = 1e-6
    max_lr: float = 1.0
    steps: int = 100
    #: the run stops once the smoothed loss exceeds this many times its lowest
    divergence: float = 4.0

    def __attrs_post_init__(self) -> None:
        if not 0 < self.min_lr < self.max_lr:
            raise InputError(f"--min-lr {self.min_lr} and --max-lr {self.max_lr}: 0 < min < max")
        if self.steps < SKIP_BEGIN + SKIP_END + 5:
            raise InputError(f"--steps {self.steps}: at least {SKIP_BEGIN + SKIP_END + 5}")

    def overrides(self) -> list[str]:
        """The plan's fields the test sets: its rate, its schedule and its length."""
        gamma = (self.max_lr / self.min_lr) ** (1 / (self.steps - 1))
        return [
            f"optimizer.lr={self.min_lr!r}",
            "schedule.name='exponential'",
            f"schedule.gamma={gamma!r}",
            "schedule.warmup_steps=0",
            f"train.max_steps={self.steps}",
            "train.epochs=1000000",  # max_steps ends it (or the divergence)
            "train.grad_accum_steps=1",
            "train.eval_every_epochs=0",  # a throwaway run: no evaluation
            "output.log_every_steps=1",
        ]


@attrs.frozen
class RangeCurve:
    """The test's steps: the rate each used, its loss, and the smoothed loss."""

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]

    @property
    def suggestion(self) -> float:
        """The rate where the smoothed loss falls fastest against log(rate)."""
        end = len(self.smoothed) - SKIP_END
        if end - SKIP_BEGIN < 3:
            raise InputError(
                f"the loss diverged after {len(self.smoothed)} steps, too soon to suggest a rate: "
                f"lower --min-lr (or --max-lr)"
            )
        window = np.asarray(self.smoothed[SKIP_BEGIN:end])
        slope = np.gradient(window, np.log(np.asarray(self.lrs[SKIP_BEGIN:end])))
        return self.lrs[SKIP_BEGIN + int(np.argmin(slope))]


def read_curve(run_dir: Path) -> RangeCurve:
    """The range test's curve from its metrics.jsonl, up to its last finite loss."""
    lrs, losses, smoothed = [], [], []
    average = SmoothedLoss()
    for record in read_metrics(run_dir):
        loss = record.get("loss")
        if "eval" in record or loss is None or not math.isfinite(loss):
            if loss is None and "eval" not in record:
                break  # a non-finite loss (written as null) ends the curve
            continue
        lrs.append(float(record["lr"]))
        losses.append(float(loss))
        smoothed.append(average.add(float(loss)))
    return RangeCurve(tuple(lrs), tuple(losses), tuple(smoothed))


def curve_rows(curve: RangeCurve, rows: int = 12) -> list[tuple[int, float, float]]:
    """About ``rows`` evenly spaced (step, rate, smoothed loss) points of the curve."""
    every = max(1, len(curve.lrs) // rows)
    picked = sorted({*range(0, len(curve.lrs), every), len(curve.lrs) - 1})
    return [(index + 1, curve.lrs[index], curve.smoothed[index]) for index in picked]


def draw_curve(curve: RangeCurve, output: Path, title: str) -> Path | None:
    """Loss against rate (log scale), the suggestion marked; None without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.plot(curve.lrs, curve.losses, alpha=0.3, label="step loss")
    axes.plot(curve.lrs, curve.smoothed, label="smoothed")
    suggestion = curve.suggestion
    axes.axvline(suggestion, color="red", linestyle="--", label=f"suggested {suggestion:.3g}")
    axes.set_xscale("log")
    top = _upper(curve.smoothed)
    axes.set_ylim(top=top)
    axes.set_xlabel("learning rate")
    axes.set_ylabel("train loss")
    axes.set_title(title)
    axes.legend()
    figure.savefig(output, dpi=100)
    return output


def _upper(smoothed: Sequence[float]) -> float:
    """Up to twice the first smoothed loss: a diverging tail would flatten the rest."""
    return 2 * max(smoothed[: max(1, len(smoothed) // 10)])
