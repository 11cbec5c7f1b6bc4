"""Step time of crosstrain's torch backend against a hand-written torch loop, in the same run.

    python benchmarks/bench_torch_step.py [--device cpu|cuda] [--precision fp32|bf16] [--steps N]

Both sides train the same MLP (same weights, same batch, Adam) in one process. The fair
native loop does what crosstrain does each step: takes the batch from host memory (as a
DataLoader hands it over) and reads the loss (as any loop that logs it does). Two more
native variants keep the batch on the device, with and without reading the loss, to show
where time goes. Prints milliseconds per step and the ratio crosstrain / native.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.core.data import Batch, StepBatch
from crosstrain.core.layers import Dense, ReLU
from crosstrain.core.loop import initial_weights
from crosstrain.core.plan import ModelSpec, OptimizerSpec, Plan, TrainSpec
from crosstrain.core.strategy import World


def make_plan(width: int, depth: int, batch: int, precision: str) -> Plan:
    layers: list[object] = []
    for _ in range(depth):
        layers += [Dense(units=width), ReLU()]
    layers.append(Dense(units=10))
    return Plan(
        name="bench",
        model=ModelSpec(input_shape=(width,), layers=tuple(layers)),  # type: ignore[arg-type]
        optimizer=OptimizerSpec(name="adam", lr=1e-3),
        train=TrainSpec(global_batch_size=batch, precision=precision),  # type: ignore[arg-type]
    )


def timed(step: Callable[[], object], steps: int, device: str) -> float:
    for _ in range(10):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    plan = make_plan(args.width, args.depth, args.batch, args.precision)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch)
    weight = np.ones(args.batch, np.float32)

    strategy = TorchStrategy(World(device=args.device), device=args.device)
    state = strategy.build(plan, initial_weights(plan))
    step_batch = StepBatch((Batch(x, y, weight),), global_real_rows=args.batch)
    crosstrain_ms = timed(lambda: strategy.train_step(state, step_batch, 1e-3), args.steps, args.device)

    native = TorchStrategy(World(device=args.device), device=args.device).build(plan, initial_weights(plan))
    model, optimizer = native.module, torch.optim.Adam(native.module.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x).to(args.device), torch.from_numpy(y).to(args.device)
    autocast = torch.autocast(
        torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.precision == "bf16"
    )

    def native_step(read_loss: bool, from_host: bool = False) -> None:
        inputs, targets = (
            (torch.from_numpy(x).to(args.device), torch.from_numpy(y).to(args.device))
            if from_host
            else (xt, yt)
        )
        with autocast:
            logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if read_loss:
            loss.item()

    native_host_ms = timed(lambda: native_step(True, from_host=True), args.steps, args.device)
    native_ms = timed(lambda: native_step(True), args.steps, args.device)
    native_nosync_ms = timed(lambda: native_step(False), args.steps, args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (1 thread)"
    print(f"device {name}  precision {args.precision}  MLP {args.depth}x{args.width}  batch {args.batch}")
    print(f"crosstrain train_step   {crosstrain_ms:8.3f} ms/step")
    rows = [
        ("native, batch from host, loss read (fair)", native_host_ms),
        ("native, batch on device, loss read", native_ms),
        ("native, batch on device, no sync", native_nosync_ms),
    ]
    for label, ms in rows:
        print(f"{label:44s} {ms:8.3f} ms/step   crosstrain/native {crosstrain_ms / ms:.3f}")


if __name__ == "__main__":
    main()
