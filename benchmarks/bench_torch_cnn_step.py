"""One training step of crosstrain's torch CNN against bench_e2e's native NCHW CNN, in-process.

    python benchmarks/bench_torch_cnn_step.py [--config cpu-cnn] [--device cpu] [--rounds 20]

Both sides train bench_e2e's config (the same architecture, batch and Adam at 1e-4) on one
batch from host memory and read nothing back: crosstrain through ``TorchStrategy.train_step``
(model, loss, Adam), the native side as bench_e2e's loop does. The two run interleaved,
``--rounds`` rounds of ``--steps`` steps each, in a random order per round (a fixed order
biased one side by up to 30 % on a shared 2-core machine), so the load hits both alike.
Prints each side's best and median round in ms/step, and the median and quartiles of the
rounds' paired ratios crosstrain / native: the steadiest figure on a noisy machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from e2e_configs import CONFIGS, plan_text

from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.run.job import World
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.planfile import load_plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="cpu-cnn", choices=[n for n in CONFIGS if "cnn" in n])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    config = CONFIGS[args.config]()
    batch = config["batch"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *config["input_shape"])).astype(np.float32)
    y = rng.integers(0, 10, size=batch)
    with tempfile.TemporaryDirectory() as folder:
        np.save(Path(folder) / "x.npy", x)
        np.save(Path(folder) / "y.npy", y)
        (Path(folder) / "plan.toml").write_text(plan_text("step", config, 1, Path(folder)))
        plan = load_plan(Path(folder) / "plan.toml")

    strategy = TorchStrategy(World(device=args.device), device=args.device)
    state = strategy.build(plan, initial_weights(plan))
    step_batch = StepBatch((Batch(x, y, np.ones(batch, np.float32)),), global_real_rows=batch)

    model = config["native"]().to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    autocast = torch.autocast(
        torch.device(args.device).type, dtype=torch.bfloat16, enabled=config["precision"] == "bf16"
    )

    def native_step() -> None:
        inputs, targets = torch.from_numpy(x).to(args.device), torch.from_numpy(y).to(args.device)
        with autocast:
            logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.float(), targets).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def one_round(step: Callable[[], object]) -> float:
        sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        return (time.perf_counter() - started) / args.steps * 1e3

    sides: dict[str, Callable[[], object]] = {
        "crosstrain": lambda: strategy.train_step(state, step_batch, 1e-4),
        "native": native_step,
    }
    for step in sides.values():  # warm-up: allocator, first-call dispatch
        one_round(step)
    times: dict[str, list[float]] = {name: [] for name in sides}
    shuffled = random.Random(0)
    for _ in range(args.rounds):
        for name in shuffled.sample(list(sides), len(sides)):
            times[name].append(one_round(sides[name]))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (1 thread)"
    print(f"device {device}  torch {torch.__version__}  config {args.config}  batch {batch}")
    for label, statistic in (("best", min), ("median", statistics.median)):
        ours, native = statistic(times["crosstrain"]), statistic(times["native"])
        print(
            f"{label:7s} crosstrain {ours:8.3f} ms/step  native {native:8.3f} ms/step  "
            f"crosstrain/native time {ours / native:.3f} (speed {native / ours:.2f}x)"
        )
    paired = np.array(times["crosstrain"]) / np.array(times["native"])
    low, middle, high = np.percentile(paired, [25, 50, 75])
    print(f"paired  crosstrain/native time: median {middle:.3f}, quartiles {low:.3f}-{high:.3f}")


if __name__ == "__main__":
    main()
