"""How `compare`'s early check separates rounding from a bug, measured over many seeds.

For each plan and seed it trains the first ``EARLY_STEPS`` steps of the reference (torch),
the candidate (tf) and two planted bugs (torch with every step's learning rate 10 % and 5 %
high), each in the plan's fp32 and again in fp64 (the fp64 probe `compare` runs beside each
backend), in this process on one CPU replica (the backends' own ``local`` strategies and
crosstrain's loop). Each pair is judged by the verdict's own rule
(``crosstrain.compare.verdict.early_bound``): DIFFERENT where the fp64 steps 1-2 differ
beyond fp32's unit roundoff, or ``FP64_FACTOR`` times the model's rounding scaled to fp64
where that is larger. It prints per plan how
many correct runs and how many bugs that calls DIFFERENT, and how far below and above the
bound they land:

    python benchmarks/compare_rounding.py --seeds 20 --json rates.json

The plans: the digits MLP, the classic Keras convnet, the small ResNet, and an MNIST-sized
ReLU/batch-norm ResNet (the digits scaled to 28x28, Adam at 3e-3), written to a temporary
folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from crosstrain.compare.difference import EARLY_STEPS, BackendRun, compare_pair
from crosstrain.compare.verdict import early_bound
from crosstrain.core.spec.planfile import load_plan

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


def _strategies() -> dict[str, Any]:
    from crosstrain.backends.tf.strategy import TfStrategy
    from crosstrain.backends.torch.strategy import TorchStrategy

    return {
        "reference": TorchStrategy,
        "candidate": TfStrategy,
        "bug10": _torch_with_lr_factor(1.10),
        "bug5": _torch_with_lr_factor(1.05),
    }


def early_losses(strategy: Any, plan_file: Path, seed: int, precision: str, out: Path) -> np.ndarray:
    from crosstrain.core.run.job import Job
    from crosstrain.core.run.loop import train

    settings = [f"seed={seed}", f"train.precision='{precision}'", f"train.max_steps={EARLY_STEPS}"]
    plan = load_plan(plan_file, settings)
    recorder = _Losses()
    job = Job(plan=plan, backend="measured", out_dir=str(out))
    train(strategy.local("cpu"), job, recorder)  # type: ignore[arg-type]  # the hooks the loop calls
    return np.array(recorder.losses, dtype=np.float64)


def _probed_run(strategy: Any, plan_file: Path, seed: int, out: Path) -> BackendRun:
    """The run's first steps in fp32, with its fp64 probe."""
    losses = early_losses(strategy, plan_file, seed, "fp32", out / "fp32")
    probe = early_losses(strategy, plan_file, seed, "fp64", out / "fp64")
    return BackendRun("measured", {"precision": "fp32"}, losses, seed, probe=probe)


def measure(plan_file: Path, seeds: Sequence[int], scratch: Path) -> list[dict[str, float]]:
    rows = []
    for seed in seeds:
        runs = {
            name: _probed_run(strategy, plan_file, seed, scratch / plan_file.stem / f"{seed}-{name}")
            for name, strategy in _strategies().items()
        }
        row: dict[str, float] = {"seed": seed}
        for name in ("candidate", "bug10", "bug5"):
            comparison = compare_pair(runs["reference"], runs[name])
            found = comparison.fp64_difference()
            row[f"{name} fp32"] = comparison.early_difference()[1]
            row[f"{name} fp64"] = found[1] if found else float("nan")
            row[f"{name} bound"] = early_bound(comparison) or float("nan")
        rows.append(row)
        print(
            "  seed {seed:2.0f}: tf fp32 {candidate fp32:.1e} fp64 {candidate fp64:.1e} (bound "
            "{candidate bound:.1e})  lr+10% fp64 {bug10 fp64:.1e}  lr+5% fp32 {bug5 fp32:.1e} "
            "fp64 {bug5 fp64:.1e} (bound {bug5 bound:.1e})".format(**row),
            flush=True,
        )
    return rows


def summarise(name: str, rows: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    def called_different(key: str) -> int:
        return sum(row[f"{key} fp64"] > row[f"{key} bound"] for row in rows)

    def ratios(key: str) -> list[float]:
        return [row[f"{key} fp64"] / row[f"{key} bound"] for row in rows]

    return {
        "plan": name,
        "seeds": len(rows),
        "correct called DIFFERENT": called_different("candidate"),
        "lr +10% called DIFFERENT": called_different("bug10"),
        "lr +5% called DIFFERENT": called_different("bug5"),
        "largest correct fp32 difference": max(row["candidate fp32"] for row in rows),
        "smallest lr +5% fp32 difference": min(row["bug5 fp32"] for row in rows),
        "largest correct fp64 difference / bound": max(ratios("candidate")),
        "smallest lr +5% fp64 difference / bound": min(ratios("bug5")),
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
