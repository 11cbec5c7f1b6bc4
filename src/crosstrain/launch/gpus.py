"""The NVIDIA GPUs this machine has, and their names, asked of the driver (``nvidia-smi``),
not of a framework; the count narrowed by ``CUDA_VISIBLE_DEVICES`` where it is set."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


def gpu_names() -> list[str]:
    """Each GPU's name as the driver lists it (``NVIDIA H100 80GB HBM3``); none without a driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        query = [smi, "--query-gpu=name", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return []


def count_gpus() -> int:
    listed = len(gpu_names())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not listed:
        return listed
    return min(listed, len([item for item in visible.split(",") if item.strip() and item.strip() != "-1"]))
