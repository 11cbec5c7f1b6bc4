"""Helpers for tests that run the real CLI; readers of a run come from crosstrain.testing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from crosstrain.testing import max_relative_difference, step_losses, summary

__all__ = [
    "CNN_PLAN", "EXAMPLES", "MLP_PLAN", "max_relative_difference", "run_cli",
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

# Every neutral layer type, on the digits as 8x8x1 images.
CNN_PLAN = """
name = "tiny_cnn"
seed = 1
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 8, kernel_size = 3, padding = "same" },
  { type = "gelu" },
  { type = "conv2d", filters = 8, kernel_size = 2, strides = 2 },
  { type = "layernorm" },
  { type = "tanh" },
  { type = "maxpool2d", pool_size = 2 },
  { type = "flatten" },
  { type = "dropout", rate = 0.1 },
  { type = "dense", units = 10 },
]
[data]
source = "digits"
[optimizer]
name = "adamw"
lr = 0.01
weight_decay = 0.01
[train]
global_batch_size = 32
epochs = 1
clip_grad_norm = 1.0
"""


def run_cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real `crosstrain` CLI in a subprocess, as a user runs it; output captured."""
    environment = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "crosstrain.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment, cwd=cwd)
