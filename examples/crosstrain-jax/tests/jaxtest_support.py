"""Helpers for tests that run the real CLI; readers of a run come from crosstrain.testing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from crosstrain.testing import max_relative_difference, step_losses, summary

__all__ = [
    "CNN_PLAN", "EXAMPLES", "MLP_PLAN", "TOKEN_PLAN", "max_relative_difference", "run_cli",
    "step_losses", "summary",
]

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parents[1]


MLP_PLAN = """
name = "tiny_mlp"
seed = 3
[model]
input_shape = [64]
layers = [{ type = "dense", units = 32 }, { type = "relu" }, { type = "dense", units = 10 }]
[data]
source = "digits"
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
[train]
global_batch_size = 32
epochs = 1
"""

# Every image layer type, on the digits as 8x8x1 images, wired as a graph: a residual add,
# two pooling branches joined by concat, batch norm after a conv and after a dense input,
# dropout. 300 rows: the epoch's last step is half padding, and with grad_accum_steps = 2
# its second micro-batch is padding only (batch norm must stay finite there).
# SGD, not Adam: Adam turns a near-zero gradient's rounding noise into full-size steps.
CNN_PLAN = """
name = "tiny_cnn"
seed = 1
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 8, kernel_size = 3, padding = "same", use_bias = false },
  { type = "batchnorm" },
  { type = "gelu", name = "g" },
  { type = "conv2d", filters = 8, kernel_size = [3, 1], padding = "same", name = "side" },
  { type = "add", inputs = ["g", "side"] },
  { type = "conv2d", filters = 8, kernel_size = 2, strides = [2, 2] },
  { type = "layernorm" },
  { type = "tanh", name = "t" },
  { type = "maxpool2d", pool_size = 2, name = "max" },
  { type = "avgpool2d", pool_size = 2, inputs = ["t"], name = "avg" },
  { type = "concat", inputs = ["max", "avg"], name = "pools" },
  { type = "flatten", name = "flat" },
  { type = "global_avg_pool2d", inputs = ["pools"], name = "gap" },
  { type = "concat", inputs = ["flat", "gap"] },
  { type = "relu" },
  { type = "batchnorm" },
  { type = "dropout", rate = 0.2 },
  { type = "dense", units = 10 },
]
[data]
source = "digits"
limit = 300
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
weight_decay = 0.001
[train]
global_batch_size = 32
epochs = 1
clip_grad_norm = 1.0
grad_accum_steps = 2
"""

# A two-block causal decoder on token windows (TOKEN_FILE is replaced by a path): int32
# input, embedding, positions, attention, residual adds, dropout, per-token cross entropy.
TOKEN_PLAN = """
name = "tiny_decoder"
seed = 5
[model]
input_shape = [16]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 32, units = 16 },
  { type = "position_embedding" },
  { type = "block", block = "decoder", repeat = 2 },
  { type = "layernorm" },
  { type = "dense", units = 32 },
]
[model.blocks.decoder]
layers = [
  { type = "layernorm" },
  { type = "attention", heads = 2, causal = true, name = "att" },
  { type = "add", inputs = ["input", "att"], name = "mixed" },
  { type = "layernorm" },
  { type = "dense", units = 32 },
  { type = "gelu" },
  { type = "dropout", rate = 0.1 },
  { type = "dense", units = 16, name = "down" },
  { type = "add", inputs = ["mixed", "down"] },
]
[data]
source = "tokens"
path = "TOKEN_FILE"
sequence_length = 16
[optimizer]
name = "adamw"
lr = 0.01
[train]
global_batch_size = 16
epochs = 1
max_steps = 12
grad_accum_steps = 2
"""


def run_cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real `crosstrain` CLI in a subprocess, as a user runs it; output captured."""
    environment = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "crosstrain.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment, cwd=cwd)
