"""The NVIDIA GPUs this machine has, counted without a framework: ``nvidia-smi -L`` (what
the driver lists), narrowed by ``CUDA_VISIBLE_DEVICES`` where it is set."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


def count_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    listed = 0
    if smi is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
            listed = sum(line.startswith("GPU ") for line in done.stdout.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not listed:
        return listed
    return min(listed, len([item for item in visible.split(",") if item.strip() and item.strip() != "-1"]))
