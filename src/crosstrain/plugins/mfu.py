"""Model FLOPs utilisation: the FLOPs a run's steps do per second against what its devices
can do, for the progress line.

A step does 3 x the model's forward FLOPs per row (forward, and a backward twice its cost:
the usual accounting, 6 N per token for a transformer of N parameters), counted from the
plan's graph (``crosstrain describe``'s figure; a native model has none). The peak is
``--peak-tflops`` per device where given, else the card's from :data:`PEAK_TFLOPS` (dense,
no sparsity; fp32 the IEEE figure, not TF32, as crosstrain's fp32 runs compute), read from
the driver's name of the first GPU. None where either is unknown (a CPU, an unlisted card).
"""

from __future__ import annotations

from collections.abc import Mapping

from crosstrain.core.run.context import RunContext
from crosstrain.launch.gpus import gpu_names

#: a step's FLOPs per row, as a multiple of the forward's
TRAIN_FLOPS_PER_FORWARD = 3
#: dense peak TFLOPS per card and precision (the vendors' data sheets); the first name that
#: occurs in the driver's card name is taken, so the longer names come first
PEAK_TFLOPS: Mapping[str, Mapping[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM (HBM3)
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def card_peak(card: str, precision: str) -> float | None:
    """The peak TFLOPS of ``card`` (the driver's name) in ``precision``; None if unlisted."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in card:
            return peaks.get(precision)
    return None


class Utilisation:
    """MFU of a run from its samples per second, where its FLOPs and its peak are known."""

    def __init__(self, flops_per_row: int, peak_tflops: float, devices: int) -> None:
        self.flops_per_row, self.peak_tflops, self.devices = flops_per_row, peak_tflops, devices

    def mfu(self, samples_per_second: float) -> float:
        done = samples_per_second * TRAIN_FLOPS_PER_FORWARD * self.flops_per_row
        return done / (self.peak_tflops * 1e12 * self.devices)

    @classmethod
    def of(cls, context: RunContext, peak_tflops: float | None) -> Utilisation | None:
        """For ``context``'s run: the plan's FLOPs, ``peak_tflops`` per device or the card's."""
        plan = context.plan
        if plan.model.native is not None:
            return None
        flops = plan.model.graph(plan.source).forward_flops_per_row
        if peak_tflops is None and context.job.device != "cpu":
            names = gpu_names()
            peak_tflops = card_peak(names[0], plan.train.precision) if names else None
        if not flops or peak_tflops is None:
            return None
        return cls(flops, peak_tflops, context.world.replicas)
