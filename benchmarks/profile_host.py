"""Where the host's time goes in a step: cProfile of one bench config's whole `crosstrain run`,
in-process (one rank, as torchrun's environment makes it), beside the native ideal loop's.

    python benchmarks/profile_host.py --config mlp1024-bf16 [--device cuda] [--epochs 2] [--ops]

Prints, per side, the top functions by own time and the seconds per step; with ``--ops``,
torch.profiler's op tables (self CPU time and calls) instead: 100 native steps, and the run's
steps through benchmarks/op_profile_plugin.py (count them by Optimizer.step's calls). A
diagnosis tool: the figures of record come from bench_e2e.py, without a profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_configs import CONFIGS, plan_text


def profile_crosstrain(plan: Path, out: Path, device: str, top: int) -> None:
    stats = out.with_suffix(".prof")
    environment = dict(os.environ) | {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577",
    }  # fmt: skip
    command = [sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "crosstrain.cli", "run"]
    command += [str(plan), "--out", str(out), "--device", "gpu" if device == "cuda" else "cpu"]
    subprocess.run(command, check=True, env=environment)
    print("== crosstrain: own time")
    pstats.Stats(str(stats)).sort_stats("tottime").print_stats(top)
    print("== crosstrain: train_step's callees")
    pstats.Stats(str(stats)).sort_stats("cumtime").print_callees("train_step|feed.py.*tensors")


def profile_crosstrain_ops(plan: Path, out: Path, device: str) -> None:
    here = str(Path(__file__).resolve().parent)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [here, environment.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "crosstrain.cli", "-p", "op_profile_plugin", "run", str(plan)]
    command += ["--out", str(out), "--device", "gpu" if device == "cuda" else "cpu", "--nproc", "1"]
    subprocess.run(command, check=True, env=environment, stdout=subprocess.DEVNULL)
    print("== crosstrain: ops,", (out / "op-profile.txt").read_text())


def profile_native(name: str, x: np.ndarray, y: np.ndarray, device: str, top: int, ops: bool) -> None:
    import torch

    config = CONFIGS[name]()
    model = config["native"]().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    xs, ys = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    autocast = config["precision"] == "bf16"

    def epoch(steps: int | None = None) -> None:
        order = torch.randperm(len(xs), device=device)
        for start in range(0, len(xs), config["batch"])[:steps]:
            index = order[start : start + config["batch"]]
            with torch.autocast(xs.device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(xs[index])
            torch.nn.functional.cross_entropy(logits.float(), ys[index]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize() if device == "cuda" else None

    epoch()
    started = time.perf_counter()
    epoch()
    steps = -(-len(xs) // config["batch"])
    print(f"== native: {1e6 * (time.perf_counter() - started) / steps:.0f} us a step, no profiler")
    if ops:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            epoch(100)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(f"== native: ops, 100 steps\n{table}")
        return
    profiler = cProfile.Profile()
    profiler.runcall(epoch)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="mlp1024-bf16", choices=list(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--ops", action="store_true", help="torch.profiler op tables, not cProfile")
    args = parser.parse_args()
    config = CONFIGS[args.config]()
    directory = Path(tempfile.mkdtemp(prefix="crosstrain-profile-"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(config["rows"], *config["input_shape"])).astype(np.float32)
    y = rng.integers(0, 10, size=config["rows"])
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", y)
    plan = directory / "plan.toml"
    plan.write_text(plan_text(args.config, config, args.epochs, directory))
    if args.ops:
        profile_crosstrain_ops(plan, directory / "run", args.device)
    else:
        profile_crosstrain(plan, directory / "run", args.device, args.top)
    profile_native(args.config, x, y, args.device, args.top, args.ops)


if __name__ == "__main__":
    main()
