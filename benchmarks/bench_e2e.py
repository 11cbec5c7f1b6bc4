"""End to end, the figure of record: the whole `crosstrain run` against loops written by hand,
in one invocation, on the same model and the same data.

    python benchmarks/bench_e2e.py [--configs mlp1024-fp32,mlp1024-bf16,mlp4096-bf16,cnn-bf16]
                                   [--device cuda] [--epochs 4] [--out DIR]

Per config it writes the data set once as .npy files and trains, each for the same epochs:

- crosstrain: ``crosstrain run`` in a subprocess (``source = "npy"``, placement auto), its
  samples/s over epochs 2..N from the epoch lines it prints (epoch 1 warms up, as below);
- native (ideal): a plain torch loop whose data already sits on the device, indexed by a
  permutation made on the device, that never reads the loss until the end;
- native, loss read each step (what a loop that logs every step pays);
- Lightning Fabric and HF Accelerate (when installed): the ideal loop with their
  ``setup``/``prepare`` and ``backward``.

The native sides skip their first epoch (warm-up) and time the rest. Prints samples/s per
side and crosstrain's ratio to each. Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

Loop = Callable[[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]], None]


# --------------------------------------------------------------------------- configs


def mlp(width: int, batch: int, precision: str, rows: int) -> dict[str, Any]:
    layers = ", ".join([f'{{ type = "dense", units = {width} }}, {{ type = "relu" }}'] * 4)
    return {
        "input_shape": [width],
        "layers": f'[{layers}, {{ type = "dense", units = 10 }}]',
        "batch": batch,
        "precision": precision,
        "rows": rows,
        "native": lambda: nn.Sequential(
            *[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 10)
        ),
    }


def cnn(batch: int, precision: str, rows: int) -> dict[str, Any]:
    layers = """[
  { type = "conv2d", filters = 64, kernel_size = 3, padding = "same" }, { type = "relu" },
  { type = "maxpool2d", pool_size = 2 },
  { type = "conv2d", filters = 128, kernel_size = 3, padding = "same" }, { type = "relu" },
  { type = "maxpool2d", pool_size = 2 },
  { type = "conv2d", filters = 256, kernel_size = 3, padding = "same" }, { type = "relu" },
  { type = "global_avg_pool2d" }, { type = "dense", units = 10 },
]"""

    class NativeCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(),
            )  # fmt: skip
            self.head = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # NHWC in, like crosstrain's data
            features = self.body(x.permute(0, 3, 1, 2).contiguous())
            return self.head(features.mean(dim=(2, 3)))  # type: ignore[no-any-return]

    return {
        "input_shape": [32, 32, 3],
        "layers": layers,
        "batch": batch,
        "precision": precision,
        "rows": rows,
        "native": NativeCNN,
    }


def gpt(batch: int, rows: int, width: int = 768, depth: int = 12, length: int = 1024) -> dict[str, Any]:
    """The decoder of examples/stdlib_gpt.toml at GPT-2-small size, on random bytes."""
    layers = f"""[
  {{ type = "embedding", vocab_size = 256, units = {width} }}, {{ type = "position_embedding" }},
  {{ type = "block", block = "decoder", repeat = {depth} }},
  {{ type = "layernorm" }}, {{ type = "dense", units = 256 }},
]
[model.blocks.decoder]
layers = [
  {{ type = "layernorm" }}, {{ type = "attention", heads = {width // 64}, causal = true, name = "att" }},
  {{ type = "add", inputs = ["input", "att"], name = "mid" }},
  {{ type = "layernorm" }}, {{ type = "dense", units = {4 * width} }}, {{ type = "gelu" }},
  {{ type = "dense", units = {width}, name = "mlp" }}, {{ type = "add", inputs = ["mid", "mlp"] }},
]"""

    class NativeGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.position = nn.Parameter(torch.zeros(length, width))
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    width,
                    width // 64,
                    4 * width,
                    dropout=0.0,
                    activation="gelu",
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(depth)
            )
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(ids) + self.position
            for block in self.blocks:
                hidden = block(hidden, src_mask=self.mask, is_causal=True)
            return self.head(self.norm(hidden))  # type: ignore[no-any-return]

    return {
        "input_shape": [length],
        "input_dtype": "int32",
        "layers": layers,
        "batch": batch,
        "precision": "bf16",
        "rows": rows,
        "tokens": True,
        "native": NativeGPT,
    }


CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "mlp1024-fp32": lambda: mlp(1024, 256, "fp32", 65536),
    "mlp1024-bf16": lambda: mlp(1024, 256, "bf16", 65536),
    "mlp4096-bf16": lambda: mlp(4096, 4096, "bf16", 65536),
    "cnn-bf16": lambda: cnn(512, "bf16", 50000),
    "gpt-bf16": lambda: gpt(16, 1024),
    # train.compile against a native loop with torch.compile and fused Adam
    "gpt-bf16-compile": lambda: gpt(16, 1024) | {"compile": True},
    # data kept on the host (placement = "host"): rows gathered by the prefetch thread and
    # copied on a side stream, against the native loop whose data sits on the GPU
    "mlp4096-bf16-host": lambda: mlp(4096, 4096, "bf16", 65536) | {"placement": "host"},
}
#: bf16 dense peak of one H200 (NVIDIA's figure), for MFU = 6 N T / time / peak
PEAK_FLOPS = 989e12


def plan_text(name: str, config: dict[str, Any], epochs: int, directory: Path) -> str:
    if config.get("tokens"):
        length = config["input_shape"][0]
        data = f'source = "tokens"\npath = "{directory / "tokens.npy"}"\nsequence_length = {length}'
    else:
        data = f'source = "npy"\nx_path = "{directory / "x.npy"}"\ny_path = "{directory / "y.npy"}"'
    data += f'\nplacement = "{config.get("placement", "auto")}"'
    return f"""
name = "{name}"
metrics = ["loss"]
[model]
input_shape = {config["input_shape"]}
input_dtype = "{config.get("input_dtype", "float32")}"
layers = {config["layers"]}
[data]
{data}
eval_fraction = 0.0
[optimizer]
name = "adam"
lr = 0.0001
[train]
global_batch_size = {config["batch"]}
epochs = {epochs}
precision = "{config["precision"]}"
compile = {"true" if config.get("compile") else "false"}
[output]
checkpoint = false
"""


# --------------------------------------------------------------------------- sides


def run_crosstrain(plan: Path, out: Path, device: str) -> float:
    """samples/s over epochs 2..N, read from the progress plugin's epoch lines."""
    command = [sys.executable, "-m", "crosstrain.cli", "run", str(plan), "--out", str(out)]
    command += ["--device", "gpu" if device == "cuda" else "cpu"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    rates = [float(line.split()[-2]) for line in result.stdout.splitlines() if line.startswith("epoch ")]
    steady = rates[1:] or rates
    return len(steady) / sum(1 / rate for rate in steady)  # equal rows per epoch: harmonic mean


def run_native(config: dict[str, Any], x: torch.Tensor, y: torch.Tensor, epochs: int, kind: str) -> float:
    """samples/s of the hand-written loop over epochs 2..N (epoch 1 warms up)."""
    device = x.device
    model = config["native"]().to(device)
    compiled = bool(config.get("compile"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=compiled or None)
    if compiled:
        model = torch.compile(model)
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()  # noqa: E731
    if kind == "fabric":
        fabric_class = _fabric_class()
        fabric = fabric_class(accelerator="cuda", devices=1, precision=_fabric_precision(config["precision"]))
        model, optimizer = fabric.setup(model, optimizer)
        backward = fabric.backward
    elif kind == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # one process runs several configs: start afresh
        accelerator = Accelerator(mixed_precision="bf16" if config["precision"] == "bf16" else "no")
        model, optimizer = accelerator.prepare(model, optimizer)
        backward = accelerator.backward
    autocast = kind in ("ideal", "read") and config["precision"] == "bf16"
    batch, rows = config["batch"], len(x)
    timed_rows, started = 0, 0.0
    for epoch in range(epochs):
        if epoch == 1:
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            started = time.perf_counter()
        order = torch.randperm(rows, device=device)
        for start in range(0, rows, batch):
            index = order[start : start + batch]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x[index])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y[index].reshape(-1)
            )
            backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if kind == "read":
                loss.item()
            if epoch >= 1:
                timed_rows += len(index)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return timed_rows / (time.perf_counter() - started)


def _fabric_precision(precision: str) -> str:
    return {"fp32": "32-true", "bf16": "bf16-mixed"}[precision]


def mfu(config: dict[str, Any], samples_per_second: float) -> float:
    """Model FLOPs utilisation: 6 x parameters x tokens per second over the peak."""
    parameters = sum(p.numel() for p in config["native"]().parameters())
    tokens = samples_per_second * config["input_shape"][0]
    return 6 * parameters * tokens / PEAK_FLOPS


def _fabric_class() -> Any:
    """Fabric from the ``lightning`` package, or from ``lightning_fabric`` (pytorch-lightning's)."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric
    return Fabric


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------- main


def benchmark(name: str, device: str, epochs: int, root: Path, rows: int | None) -> dict[str, float]:
    config = CONFIGS[name]()
    config["rows"] = rows or config["rows"]
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if config.get("tokens"):  # windows of random bytes; y is x shifted by one
        length = config["input_shape"][0]
        tokens = rng.integers(0, 256, size=config["rows"] * length + 1, dtype=np.uint8)
        np.save(directory / "tokens.npy", tokens)
        starts = np.arange(config["rows"])[:, None] * length + np.arange(length)[None, :]
        x, y = tokens[starts].astype(np.int32), tokens[starts + 1].astype(np.int64)
    else:
        x = rng.normal(size=(config["rows"], *config["input_shape"])).astype(np.float32)
        y = rng.integers(0, 10, size=config["rows"])
        np.save(directory / "x.npy", x)
        np.save(directory / "y.npy", y)
    plan = directory / "plan.toml"
    plan.write_text(plan_text(name, config, epochs, directory))
    results = {"crosstrain": run_crosstrain(plan, directory / "run", device)}
    x_device, y_device = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    kinds = ["ideal", "read"]
    kinds += [
        kind for kind, module in (("fabric", "lightning"), ("accelerate", "accelerate")) if _available(module)
    ]
    # Fabric and Accelerate against the eager loops only (their compile paths differ)
    for kind in kinds if device == "cuda" and not config.get("compile") else kinds[:2]:
        results[kind] = run_native(config, x_device, y_device, epochs, kind)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--out", default=None, help="where the data and runs go (default: a temporary folder)"
    )
    parser.add_argument("--rows", type=int, default=None, help="rows of data (default: each config's)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {args.epochs} epochs per side (samples/s)")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(args.out or temporary)
        for config in args.configs.split(","):
            results = benchmark(config, args.device, args.epochs, root, args.rows)
            crosstrain = results["crosstrain"]
            ratios = "  ".join(
                f"{kind} {value:,.0f} ({crosstrain / value:.2f}x)"
                for kind, value in results.items()
                if kind != "crosstrain"
            )
            print(f"{config:14s} crosstrain {crosstrain:,.0f}  |  {ratios}", flush=True)
            if config.startswith("gpt") and args.device == "cuda":
                print(
                    f"{'':14s} MFU (6 N T / {PEAK_FLOPS / 1e12:.0f} TFLOP/s): "
                    + "  ".join(
                        f"{kind} {mfu(CONFIGS[config](), value):.1%}" for kind, value in results.items()
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
