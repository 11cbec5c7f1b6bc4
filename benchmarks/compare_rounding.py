"""How `compare`'s early check separates rounding from a bug, measured over many seeds.

For each plan and seed it trains the first ``EARLY_STEPS`` steps five ways: the reference
(torch, one replica), the candidate (tf, one replica), two planted bugs (torch with every
step's learning rate 10 % and 5 % high) — each in this process on the CPU, with the
backends' own ``local`` strategies and crosstrain's loop — and the rounding probe `compare`
runs (torch at two replicas, through the ``crosstrain`` CLI: real processes, the gradients
all-reduced). It prints, per plan, the reference's own rounding the probe measures, how far
above the bound it gives (``ROUNDING_FACTOR`` times it) the correct candidate and the bugs
land, and how many runs the verdict's rule calls DIFFERENT:

    python benchmarks/compare_rounding.py --seeds 20 --json rates.json

The plans: the digits MLP, the classic Keras convnet, the small ResNet, and an MNIST-sized
ReLU/batch-norm ResNet (the digits scaled to 28x28, Adam at 3e-3), written to a temporary
folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from crosstrain.compare.difference import EARLY_STEPS, step_relative_differences
from crosstrain.compare.verdict import early_bound
from crosstrain.core.planfile import load_plan

REPOSITORY = Path(__file__).resolve().parents[1]
PLANS = REPOSITORY / "tests" / "cross" / "plans"

MNIST_SIZED_RESNET = """
name = "mnist_sized_resnet"
seed = 0
metrics = ["loss", "accuracy"]

[model]
input_shape = [28, 28, 1]
layers = [
  { type = "conv2d", filters = 16, kernel_size = 3, padding = "same" },
  { type = "batchnorm" },
  { type = "relu" },
  { type = "block", block = "residual", repeat = 2 },
  { type = "conv2d", filters = 32, kernel_size = 3, strides = 2, padding = "same" },
  { type = "batchnorm" },
  { type = "relu" },
  { type = "global_avg_pool2d" },
  { type = "dense", units = 10 },
]

[model.blocks.residual]
layers = [
  { type = "conv2d", filters = 16, kernel_size = 3, padding = "same" },
  { type = "batchnorm" },
  { type = "relu" },
  { type = "conv2d", filters = 16, kernel_size = 3, padding = "same" },
  { type = "batchnorm", name = "branch" },
  { type = "add", inputs = ["input", "branch"] },
  { type = "relu" },
]

[data]
source = "npz"
path = "PATH"
eval_fraction = 0.2

[loss]
name = "cross_entropy"

[optimizer]
name = "adam"
lr = 0.003

[train]
global_batch_size = 64
epochs = 1
"""


def write_mnist_sized_plan(folder: Path) -> Path:
    """The digits, each pixel 3x3 and a 2-pixel border: 28x28 uint8 images as MNIST's."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images, np.ones((3, 3)))  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    x = (images * (255 / 16)).round().astype(np.uint8)[..., None]
    np.savez(folder / "digits28.npz", x=x, y=digits.target.astype(np.int64))
    plan = folder / "mnist_sized_resnet.toml"
    plan.write_text(MNIST_SIZED_RESNET.replace("PATH", str(folder / "digits28.npz")), encoding="utf-8")
    return plan


class _Losses:
    """The loop's hooks: every step's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def crosstrain_step_end(self, metrics: Mapping[str, float], **_: Any) -> None:
        self.losses.append(metrics["loss"])

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda **kwargs: None


def _torch_with_lr_factor(factor: float) -> type:
    from crosstrain.backends.torch.strategy import TorchStrategy

    class PlantedBug(TorchStrategy):
        def train_step(self, state: Any, step: Any, lr: float) -> dict[str, Any]:
            return super().train_step(state, step, lr * factor)

    return PlantedBug


def _strategies() -> dict[str, tuple[type, str]]:
    from crosstrain.backends.tf.strategy import TfStrategy
    from crosstrain.backends.torch.strategy import TorchStrategy

    return {
        "reference": (TorchStrategy, "fp32"),
        "candidate": (TfStrategy, "fp32"),
        "bug10": (_torch_with_lr_factor(1.10), "fp32"),
        "bug5": (_torch_with_lr_factor(1.05), "fp32"),
    }


def early_losses(strategy: Any, plan_file: Path, seed: int, precision: str, out: Path) -> np.ndarray:
    from crosstrain.core.loop import train
    from crosstrain.core.strategy import Job

    settings = [f"seed={seed}", f"train.precision='{precision}'", f"train.max_steps={EARLY_STEPS}"]
    plan = load_plan(plan_file, settings)
    recorder = _Losses()
    job = Job(plan=plan, backend="measured", out_dir=str(out))
    train(strategy.local("cpu"), job, recorder)  # type: ignore[arg-type]  # the hooks the loop calls
    return np.array(recorder.losses, dtype=np.float64)


def probe_losses(plan_file: Path, seed: int, out: Path) -> np.ndarray:
    """The rounding probe as `compare` runs it: two torch replicas, real processes."""
    from crosstrain.compare.folders import read_step_losses

    command = [
        sys.executable, "-m", "crosstrain.cli", "-p", "no:progress", "run", str(plan_file),
        "--backend", "torch", "--nproc", "2", "--device", "cpu", "--out", str(out),
        "--set", f"seed={seed}", "--set", f"train.max_steps={EARLY_STEPS}",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return read_step_losses(out)


def _largest(reference: np.ndarray, other: np.ndarray) -> float:
    return float(step_relative_differences(reference, other).max())


def measure(plan_file: Path, seeds: Sequence[int], scratch: Path) -> list[dict[str, float]]:
    rows = []
    for seed in seeds:
        losses = {
            name: early_losses(
                strategy, plan_file, seed, precision, scratch / f"{plan_file.stem}-{seed}-{name}"
            )
            for name, (strategy, precision) in _strategies().items()
        }
        reference = losses["reference"]
        floor = _largest(reference, probe_losses(plan_file, seed, scratch / plan_file.stem / f"{seed}-probe"))
        bound = early_bound("fp32", floor)
        row = {"seed": seed, "floor": floor, "bound": float(bound or 0.0)}
        for name in ("candidate", "bug10", "bug5"):
            row[name] = _largest(reference, losses[name])
        rows.append(row)
        print(
            f"  seed {seed:2d}: floor {floor:.1e}  bound {bound:.1e}  tf {row['candidate']:.1e}  "
            f"lr+10% {row['bug10']:.1e}  lr+5% {row['bug5']:.1e}",
            flush=True,
        )
    return rows


def summarise(name: str, rows: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    def called_different(key: str) -> int:
        return sum(row[key] > row["bound"] for row in rows)

    ratios = {key: [row[key] / row["bound"] for row in rows] for key in ("candidate", "bug10", "bug5")}
    return {
        "plan": name,
        "seeds": len(rows),
        "floor": [min(row["floor"] for row in rows), max(row["floor"] for row in rows)],
        "correct called DIFFERENT": called_different("candidate"),
        "lr +10% called DIFFERENT": called_different("bug10"),
        "lr +5% called DIFFERENT": called_different("bug5"),
        "largest correct difference / bound": max(ratios["candidate"]),
        "smallest lr +5% difference / bound": min(ratios["bug5"]),
        "rows": list(rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--plans", default="mlp,keras_convnet,small_resnet,mnist_sized_resnet")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(temporary)
        plans = {
            "mlp": PLANS / "digits_mlp.toml",
            "keras_convnet": PLANS / "digits_keras_convnet.toml",
            "small_resnet": PLANS / "digits_small_resnet.toml",
            "mnist_sized_resnet": write_mnist_sized_plan(scratch),
        }
        results = []
        for name in args.plans.split(","):
            print(f"{name}:", flush=True)
            results.append(summarise(name, measure(plans[name], range(args.seeds), scratch)))
            shown = {key: value for key, value in results[-1].items() if key != "rows"}
            print(json.dumps(shown), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
