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

import numpy as np
import torch

from _shared import add_size_arguments, make_plan, print_report, timed
from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.run.job import World
from crosstrain.core.run.loop import initial_weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_size_arguments(parser)
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

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    crosstrain_ms = timed(lambda: strategy.train_step(state, step_batch, 1e-3), args.steps, sync)

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

    native_host_ms = timed(lambda: native_step(True, from_host=True), args.steps, sync)
    native_ms = timed(lambda: native_step(True), args.steps, sync)
    native_nosync_ms = timed(lambda: native_step(False), args.steps, sync)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (1 thread)"
    header = f"device {name}  precision {args.precision}  MLP {args.depth}x{args.width}  batch {args.batch}"
    print_report(header, crosstrain_ms, native_host_ms, native_ms, native_nosync_ms)


if __name__ == "__main__":
    main()
