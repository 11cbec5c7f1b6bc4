"""What both step benchmarks share: the plan they train, the timer, the options and the report."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from crosstrain.core.model.layers import Dense, Layer, ReLU
from crosstrain.core.spec.plan import ModelSpec, OptimizerSpec, Plan, Precision, TrainSpec


def make_plan(width: int, depth: int, batch: int, precision: Precision) -> Plan:
    """An MLP of ``depth`` hidden layers of ``width`` units, 10 classes, Adam at 1e-3."""
    layers: list[Layer] = []
    for _ in range(depth):
        layers += [Dense(units=width), ReLU()]
    layers.append(Dense(units=10))
    return Plan(
        name="bench",
        model=ModelSpec(input_shape=(width,), layers=tuple(layers)),
        optimizer=OptimizerSpec(name="adam", lr=1e-3),
        train=TrainSpec(global_batch_size=batch, precision=precision),
    )


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)


def timed(step: Callable[[], object], steps: int, sync: Callable[[], None]) -> float:
    """Milliseconds per call after 10 warm-up calls (tracing, compilation, allocator)."""
    for _ in range(10):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - started) / steps * 1e3


def print_report(
    header: str, crosstrain_ms: float, host_ms: float, device_ms: float, nosync_ms: float
) -> None:
    print(header)
    print(f"crosstrain train_step   {crosstrain_ms:8.3f} ms/step")
    rows = [
        ("native, batch from host, loss read (fair)", host_ms),
        ("native, batch on device, loss read", device_ms),
        ("native, batch on device, no sync", nosync_ms),
    ]
    for label, ms in rows:
        print(f"{label:44s} {ms:8.3f} ms/step   crosstrain/native {crosstrain_ms / ms:.3f}")
