"""What crosstrain's loop costs the host per step, whatever the backend: a backend whose step
does nothing, trained through the worker (the built-in plugins loaded: metrics.jsonl, the
progress line) in this process.

    python benchmarks/bench_loop_floor.py [--rounds 3] [--epochs 8]

The loop's share of every real step: the sampler's next batch, the step log (chunked reads,
metrics.jsonl, progress), the heartbeat, the schedule. "rows read" also has the step read
its rows on the host (what a backend whose data is not placed pays: core's numpy gather).
A step replayed as one CUDA graph leaves the host little else to do, so this is the floor
under such a step's time. Prints microseconds per step, the best of the rounds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from crosstrain.core.run.job import Job
from crosstrain.core.run.worker import run_worker
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins.manager import hook_relay
from crosstrain.testing.null import NullStrategy

ROWS, FEATURES, BATCH = 65536, 16, 256


def write_plan(folder: Path, epochs: int) -> Path:
    rng = np.random.default_rng(0)
    np.save(folder / "x.npy", rng.normal(size=(ROWS, FEATURES)).astype(np.float32))
    np.save(folder / "y.npy", rng.integers(0, 10, ROWS))
    plan = folder / "floor.toml"
    plan.write_text(
        f'name = "loop_floor"\n[model]\ninput_shape = [{FEATURES}]\n'
        '[[model.layers]]\ntype = "dense"\nunits = 10\n'
        f'[data]\nsource = "npy"\nx_path = "x.npy"\ny_path = "y.npy"\neval_fraction = 0.01\n'
        f"[train]\nglobal_batch_size = {BATCH}\nepochs = {epochs}\n"
    )
    return plan


def microseconds_per_step(plan_file: Path, out: Path, read_rows: bool) -> float:
    plan = load_plan(plan_file, ["output.checkpoint=false"])
    summary = run_worker(
        NullStrategy(read_rows), Job(plan=plan, backend="null", out_dir=str(out), load_hooks=hook_relay)
    )
    return 1e6 * BATCH / float(summary["samples_per_second"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        plan = write_plan(Path(folder), args.epochs)
        for label, read_rows in (("indices only", False), ("rows read", True)):
            times = [
                microseconds_per_step(plan, Path(folder) / f"run{index}", read_rows)
                for index in range(args.rounds)
            ]
            rounds = " ".join(f"{value:.1f}" for value in times)
            print(f"{label}: {min(times):.1f} us a step (rounds: {rounds})")


if __name__ == "__main__":
    main()
