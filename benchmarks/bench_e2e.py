"""End to end, the figure of record: the whole `crosstrain run` against loops written by hand,
in one invocation, on the same model and the same data.

    python benchmarks/bench_e2e.py [--configs mlp1024-fp32,mlp1024-bf16,mlp4096-bf16,cnn-bf16]
                                   [--device cuda] [--epochs 4] [--out DIR]
    python benchmarks/bench_e2e.py --device cpu --backend torch|tf --configs cpu-mlp256,cpu-cnn
    python benchmarks/bench_e2e.py --configs gpt2-small-compile,resnet50-bf16 [--peak-tflops 989]
    python benchmarks/bench_e2e.py --device cpu --tiny --configs gpt2-small-compile,resnet50-bf16

Per config it writes the data set once as .npy files and trains, each for the same epochs:

- crosstrain: ``crosstrain run`` in a subprocess (``source = "npy"``, placement auto), its
  samples/s over epochs 2..N from the epoch lines it prints (epoch 1 warms up, as below);
- crosstrain, launched (torch on a GPU): the same run with ``train.cuda_graph = false``,
  every kernel launched each step (the ratio says what replaying the step as a graph buys);
- native (ideal): a plain torch loop whose data already sits on the device, indexed by a
  permutation made on the device, that never reads the loss until the end;
- native, loss read each step (what a loop that logs every step pays);
- Lightning Fabric and HF Accelerate (when installed): the ideal loop with their
  ``setup``/``prepare`` and ``backward``.

The native sides skip their first epoch (warm-up) and time the rest. Prints samples/s per
side and crosstrain's ratio to each; for token configs also tokens/s and, on a GPU, MFU. Speed
is measured here, never asserted in tests.

Issue 26's configs train GPT-2 small (tied output, vocabulary 50,304) and the zoo's ResNet-50
against native twins written as their communities write them (nanoGPT's model; torchvision's
resnet50 in channels-last), each with its own optimizer and its loss inside the compiled
module. ``--tiny`` runs those configs' sides at a CPU's size: a smoke run, not a figure.

``--backend tf`` (CPU only) runs ``crosstrain run --backend tf`` against the same two native
loops written in TensorFlow 2: a ``tf.function`` step with a ``GradientTape`` over Keras
layers of the same architecture, the data in tf tensors, Adam at 1e-4. On CPU every side
runs on one thread (torch, TensorFlow's op pools, ``OMP_NUM_THREADS`` of the subprocess).
Only the chosen backend's framework is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from e2e_configs import CONFIGS, IMAGE_SCALING, PEAK_FLOPS, TINY_CONFIGS, available, plan_text

if TYPE_CHECKING:  # imported where used: a tf run never loads torch, a torch run never tf
    import torch
    from torch import nn

#: before TensorFlow is imported: quiet logs, no oneDNN (as crosstrain's tf workers)
TF_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "KERAS_BACKEND": "tensorflow"}


# --------------------------------------------------------------------------- sides


def run_crosstrain(
    plan: Path, out: Path, device: str, backend: str, settings: tuple[str, ...] = ()
) -> tuple[list[float], dict[str, Any]]:
    """samples/s of each epoch 2..N, read from the progress plugin's epoch lines; and rank 0's
    report from summary.json (data_seconds, step_seconds, cpu_seconds). On the CPU every worker
    computes on one thread (crosstrain's own setting), as the native loops do."""
    command = [sys.executable, "-m", "crosstrain.cli", "run", str(plan), "--out", str(out)]
    command += ["--backend", backend, "--device", "gpu" if device == "cuda" else "cpu"]
    command += [item for setting in settings for item in ("--set", setting)]
    environment = dict(os.environ)
    if device == "cpu":  # one thread, as the native sides
        environment |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if backend == "tf":
        environment |= TF_ENVIRONMENT
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode:  # what went wrong, not only that it did
        raise SystemExit(f"crosstrain run {plan} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    rates = [_samples_per_second(line) for line in result.stdout.splitlines() if line.startswith("epoch ")]
    summary = json.loads((out / "summary.json").read_text())
    return rates[1:] or rates, (summary.get("ranks") or [{}])[0]


def _samples_per_second(epoch_line: str) -> float:
    """The figure before "samples/s" in a progress epoch line (an MFU may follow it)."""
    words = epoch_line.split()
    return float(words[words.index("samples/s") - 1])


def run_native(
    config: dict[str, Any], x: torch.Tensor, y: torch.Tensor, epochs: int, kind: str
) -> tuple[list[float], list[float]]:
    """samples/s of the hand-written loop in each epoch 2..N (epoch 1 warms up), by the
    wall clock and per CPU second of this process."""
    import torch

    device = x.device
    model = config["native"]().to(device)
    if config.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    compiled = bool(config.get("compile"))
    optimizer = config.get("native_optimizer", _native_adam)(model, compiled)
    if config.get("loss_inside"):  # one compiled graph from the rows to the loss (nanoGPT's)
        model = _with_loss(model)
    if compiled:  # as crosstrain compiles one CUDA process: the step replayed as CUDA graphs
        model = torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else None)
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
    rates, cpu_rates = [], []
    for _ in range(epochs):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        started, cpu_started = time.perf_counter(), time.process_time()
        order = torch.randperm(rows, device=device)
        for start in range(0, rows, batch):
            index = order[start : start + batch]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                outputs = model(x[index], y[index]) if config.get("loss_inside") else model(x[index])
            loss = outputs if config.get("loss_inside") else _cross_entropy(outputs, y[index])
            backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if kind == "read":
                loss.item()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        rates.append(rows / (time.perf_counter() - started))
        cpu_rates.append(rows / (time.process_time() - cpu_started))
    return rates[1:], cpu_rates[1:]


def _native_adam(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    """The native loops' default: Adam at 1e-4, fused when compiled."""
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused or None)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over every target position, in float32."""
    from torch import nn

    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _with_loss(model: nn.Module) -> nn.Module:
    """``model`` returning its mean cross-entropy: (rows, labels) -> loss."""
    from torch import nn

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _cross_entropy(self.model(x), y)

    return WithLoss()


def configure_tf() -> Any:
    """TensorFlow on one CPU thread, no GPU; before any TensorFlow op. Returns the module."""
    os.environ.update(TF_ENVIRONMENT)
    os.environ.setdefault("KERAS_HOME", os.path.join(tempfile.gettempdir(), "crosstrain-bench-keras"))
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def run_native_tf(
    config: dict[str, Any], x: np.ndarray, y: np.ndarray, epochs: int, kind: str
) -> tuple[list[float], list[float]]:
    """The TensorFlow 2 loop: a ``tf.function`` step (gather the rows, GradientTape, Adam)
    over the data held in tf tensors; samples/s of each epoch 2..N (epoch 1 traces).
    ``ideal`` reads the loss only at the end, ``read`` every step."""
    import keras
    import tensorflow as tf

    if config["precision"] != "fp32":
        raise SystemExit(f"--backend tf: the native tf loop is fp32 only, not {config['precision']}")
    model = config["native_tf"]()
    optimizer = keras.optimizers.Adam(learning_rate=1e-4)
    optimizer.build(model.trainable_variables)
    inputs, targets = tf.constant(x), tf.constant(y)

    @tf.function
    def step(index: Any) -> Any:
        rows, labels = tf.gather(inputs, index), tf.gather(targets, index)
        with tf.GradientTape() as tape:
            logits = model(rows, training=True)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    batch, rows = config["batch"], len(x)
    rates, cpu_rates, loss = [], [], None
    for _ in range(epochs):
        started, cpu_started = time.perf_counter(), time.process_time()
        order = tf.random.shuffle(tf.range(rows))
        for start in range(0, rows, batch):
            loss = step(order[start : start + batch])
            if kind == "read":
                float(loss)
        # a tf.function call on the CPU returns once its ops have run: the clock is fair
        rates.append(rows / (time.perf_counter() - started))
        cpu_rates.append(rows / (time.process_time() - cpu_started))
    float(loss)  # the ideal loop's only read
    return rates[1:], cpu_rates[1:]


def _fabric_precision(precision: str) -> str:
    return {"fp32": "32-true", "bf16": "bf16-mixed"}[precision]


def harmonic_mean(rates: list[float]) -> float:
    """Equal rows per epoch: total rows over total time."""
    return len(rates) / sum(1 / rate for rate in rates)


def round_ratios(epochs: dict[str, list[float]], rounds: int) -> str:
    """crosstrain / ideal of each round's mean (each side's epochs, round after round)."""
    timed = len(epochs["ideal"]) // rounds
    ratios = []
    for index in range(rounds):
        part = slice(index * timed, (index + 1) * timed)
        ratios.append(harmonic_mean(epochs["crosstrain"][part]) / harmonic_mean(epochs["ideal"][part]))
    return "  ".join(f"{ratio:.2f}x" for ratio in ratios)


def mfu(config: dict[str, Any], samples_per_second: float, peak: float = PEAK_FLOPS) -> float:
    """Model FLOPs utilisation: per token 6 N for the weights' matmuls (N parameters, the
    native twin's: a tied table counted once, the position table included) plus 12 L d T
    for attention's scores and weighted sums (L blocks, width d, sequence T: the PaLM
    paper's count), times tokens per second, over ``peak`` FLOP/s."""
    return flops_per_token(config) * samples_per_second * config["input_shape"][0] / peak


def flops_per_token(config: dict[str, Any]) -> int:
    """6 N + 12 L d T of :func:`mfu`; the parameters counted on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        parameters = sum(p.numel() for p in config["native"]().parameters())
    return int(6 * parameters + 12 * config["depth"] * config["width"] * config["input_shape"][0])


def print_token_rates(config: dict[str, Any], results: dict[str, float], device: str, peak: float) -> None:
    """A token config's tokens/s per side and, on a GPU, its MFU over ``peak`` FLOP/s."""
    if not config.get("tokens"):
        return
    length = config["input_shape"][0]
    rates = "  ".join(f"{kind} {value * length:,.0f}" for kind, value in results.items())
    print(f"{'tokens/s':14s} {rates}", flush=True)
    if device == "cuda":
        print(
            f"{'':14s} MFU ((6 N + 12 L d T) T / {peak / 1e12:.0f} TFLOP/s, "
            f"{flops_per_token(config) / 1e9:.3f} GFLOP a token): "
            + "  ".join(f"{kind} {mfu(config, value, peak):.1%}" for kind, value in results.items()),
            flush=True,
        )


def _fabric_class() -> Any:
    """Fabric from the ``lightning`` package, or from ``lightning_fabric`` (pytorch-lightning's)."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric
    return Fabric


def _replayed_as_a_graph(plan: Path, settings: tuple[str, ...] = ()) -> bool:
    """Whether crosstrain replays this plan's step as one CUDA graph on one GPU."""
    from crosstrain.backends.torch.graphs import capture_blocker
    from crosstrain.core.spec.planfile import load_plan

    return capture_blocker(load_plan(plan, settings), "cuda", 1) is None


# --------------------------------------------------------------------------- main


def config_of(name: str, tiny: bool = False) -> dict[str, Any]:
    """The config ``name``, at its ``--tiny`` size when asked."""
    return (TINY_CONFIGS if tiny else CONFIGS)[name]()


def benchmark(
    name: str,
    device: str,
    backend: str,
    epochs: int,
    root: Path,
    rows: int | None,
    rounds: int = 1,
    tiny: bool = False,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    """samples/s of each timed epoch per side by the wall clock (every side once per round,
    in turn: a host whose speed drifts over minutes moves every side alike); on the CPU,
    samples per CPU second per side; and crosstrain's time split (summary.json)."""
    results: dict[str, list[float]] = {}
    cpu_results: dict[str, list[float]] = {}
    for round_index in range(rounds):
        round_results, round_cpu, split = _benchmark_round(
            name, device, backend, epochs, root / f"round-{round_index}", rows, tiny
        )
        for into, found in ((results, round_results), (cpu_results, round_cpu)):
            for kind, rates in found.items():
                into.setdefault(kind, []).extend(rates)
    return results, cpu_results, split


def _benchmark_round(
    name: str, device: str, backend: str, epochs: int, root: Path, rows: int | None, tiny: bool = False
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    config = config_of(name, tiny)
    config["rows"] = rows or config["rows"]
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    classes = config.get("classes", 10)
    if config.get("tokens"):  # windows of random token ids (bytes by default); y is x shifted by one
        length, vocab = config["input_shape"][0], config.get("vocab", 256)
        dtype = np.uint8 if vocab <= 256 else np.uint16
        tokens = rng.integers(0, vocab, size=config["rows"] * length + 1, dtype=dtype)
        np.save(directory / "tokens.npy", tokens)
        starts = np.arange(config["rows"])[:, None] * length + np.arange(length)[None, :]
        x, y = tokens[starts].astype(np.int32), tokens[starts + 1].astype(np.int64)
    elif config.get("images"):  # crosstrain reads the pixels; the native loops, them scaled
        pixels = rng.integers(0, 256, size=(config["rows"], *config["input_shape"]), dtype=np.uint8)
        x, y = IMAGE_SCALING.apply(pixels), rng.integers(0, classes, size=config["rows"])
        np.save(directory / "x.npy", pixels)
        np.save(directory / "y.npy", y)
    else:
        x = rng.normal(size=(config["rows"], *config["input_shape"])).astype(np.float32)
        y = rng.integers(0, classes, size=config["rows"])
        np.save(directory / "x.npy", x)
        np.save(directory / "y.npy", y)
    plan = directory / "plan.toml"
    plan.write_text(plan_text(name, config, epochs, directory))
    settings = config.get("settings", ())
    rates, split = run_crosstrain(plan, directory / "run", device, backend, settings)
    results, cpu_results = {"crosstrain": rates}, {}
    if device == "cuda" and backend == "torch" and _replayed_as_a_graph(plan, settings):
        # the same run with every kernel launched: what replaying the step as one CUDA
        # graph (train.cuda_graph, on where the step can be captured) buys
        launched = directory / "plan-launched.toml"
        launched.write_text(plan_text(name, config | {"launched": True}, epochs, directory))
        results["launched"], _ = run_crosstrain(
            launched, directory / "run-launched", device, backend, settings
        )
    if device == "cpu" and epochs > 1:
        # CPU seconds per epoch of rank 0 while it trains (every thread of the worker; the
        # launcher only waits), the first epoch taken out by a 1-epoch run: a figure others'
        # load hardly moves. (The whole run's CPU time, start-up included, varied by seconds.)
        short = directory / "plan-1-epoch.toml"
        short.write_text(plan_text(name, config, 1, directory))
        _, one_epoch = run_crosstrain(short, directory / "run-1-epoch", device, backend, settings)
        per_epoch = (split["cpu_seconds"] - one_epoch["cpu_seconds"]) / (epochs - 1)
        cpu_results["crosstrain"] = [config["rows"] / per_epoch]
    if backend == "tf":
        for kind in ("ideal", "read"):
            results[kind], cpu_results[kind] = run_native_tf(config, x, y, epochs, kind)
        return results, cpu_results, split
    import torch

    x_device, y_device = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    kinds = ["ideal", "read"]
    if device == "cuda" and not config.get("compile"):  # Fabric and Accelerate against the eager
        kinds += [  # loops only (their compile paths differ)
            kind
            for kind, module in (("fabric", "lightning"), ("accelerate", "accelerate"))
            if available(module)
        ]
    # a config may keep fewer (a compiled twin of a large model compiles once, for the ideal loop)
    for kind in [kind for kind in kinds if kind in config.get("native_kinds", kinds)]:
        results[kind], cpu_rates = run_native(config, x_device, y_device, epochs, kind)
        if cpu_results:
            cpu_results[kind] = cpu_rates
    return results, cpu_results, split


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The configs to run; refuses a bad choice before anything is written or started."""
    names = args.configs.split(",")
    known = TINY_CONFIGS if args.tiny else CONFIGS
    unknown = [name for name in names if name not in known]
    if unknown:
        sized = "with a --tiny size" if args.tiny else "known"
        parser.error(f"--configs: unknown {', '.join(unknown)} ({sized}: {', '.join(known)})")
    needs = {config_of(name, args.tiny).get("needs") for name in names}
    missing = sorted(module for module in needs if isinstance(module, str) and not available(module))
    if missing:
        parser.error(f"--configs: the native twin needs {', '.join(missing)}: pip install it")
    if args.backend == "tf":
        if args.device != "cpu":
            parser.error("--backend tf runs on --device cpu only")
        torch_only = [name for name in names if "native_tf" not in CONFIGS[name]()]
        if torch_only:
            parser.error(f"--backend tf: no native tf loop for {', '.join(torch_only)}")
    return names


def header(device: str, backend: str) -> str:
    """The device and framework version; imports only the chosen backend's framework."""
    if backend == "tf":
        tf = configure_tf()
        return f"cpu (1 thread), tensorflow {tf.__version__}"
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
        return f"cpu (1 thread), torch {torch.__version__}"
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--configs", default=",".join(name for name in CONFIGS if not name.startswith("cpu-"))
    )
    parser.add_argument("--backend", default="torch", choices=("torch", "tf"))
    parser.add_argument(
        "--device", default=None, choices=("cuda", "cpu"), help="default: cuda if torch sees one"
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--out", default=None, help="where the data and runs go (default: a temporary folder)"
    )
    parser.add_argument("--rows", type=int, default=None, help="rows of data (default: each config's)")
    parser.add_argument("--rounds", type=int, default=1, help="every side this many times, in turn")
    parser.add_argument(
        "--tiny", action="store_true", help="the configs at a size a CPU runs in seconds (a smoke run)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=PEAK_FLOPS / 1e12, help="what MFU divides by (bf16 matrix rate)"
    )
    args = parser.parse_args()
    if args.device is None:
        if args.backend == "tf":
            args.device = "cpu"
        else:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
    names = check_arguments(parser, args)
    print(f"device {header(args.device, args.backend)}, {args.epochs} epochs per side (samples/s)")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(args.out or temporary)
        for config in names:
            epochs, cpu_epochs, split = benchmark(
                config, args.device, args.backend, args.epochs, root, args.rows, args.rounds, args.tiny
            )
            # the mean over the timed epochs; on a shared machine also the best epoch of each
            # side and, on the CPU, samples per CPU second
            for label, source, statistic in (
                ("", epochs, harmonic_mean),
                ("best epoch", epochs, max),
                ("per cpu s", cpu_epochs, harmonic_mean),
            ):
                if not source:
                    continue
                results = {kind: statistic(rates) for kind, rates in source.items()}
                crosstrain = results["crosstrain"]
                ratios = "  ".join(
                    f"{kind} {value:,.0f} ({crosstrain / value:.2f}x)"
                    for kind, value in results.items()
                    if kind != "crosstrain"
                )
                print(f"{label or config:14s} crosstrain {crosstrain:,.0f}  |  {ratios}", flush=True)
            if args.rounds > 1:  # crosstrain / ideal in each round: how far the host drifts
                print(f"{'per round':14s} crosstrain / ideal {round_ratios(epochs, args.rounds)}", flush=True)
            results = {kind: harmonic_mean(rates) for kind, rates in epochs.items()}
            if "step_seconds" in split:  # all epochs, epoch 1 included
                print(
                    f"{'':14s} crosstrain rank 0: data {split['data_seconds']:.2f} s, "
                    f"steps {split['step_seconds']:.2f} s",
                    flush=True,
                )
            print_token_rates(config_of(config, args.tiny), results, args.device, args.peak_tflops * 1e12)


if __name__ == "__main__":
    main()
