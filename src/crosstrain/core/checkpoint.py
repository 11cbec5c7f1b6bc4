"""Checkpoints: neutral names and channels-last layouts in safetensors, readable by any backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def save_checkpoint(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write atomically: a crash mid-write never replaces a good checkpoint with a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    contiguous = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    save_file(contiguous, str(temporary), metadata=dict(metadata))
    os.replace(temporary, path)


def load_checkpoint(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path))
