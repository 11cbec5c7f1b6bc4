"""The model zoo (``examples/zoo``) in the conformance suite: each plan as shipped, the
``--set`` settings that scale it down to a run of seconds on a CPU, and the arrays it trains
on there.

The plans are package data (``crosstrain/testing/zoo_plans``), word for word the files of
``examples/zoo`` (a test keeps them equal), so a third party's backend, installed beside
crosstrain from a wheel, runs the zoo through the suite as crosstrain's own backends do.

Why these small versions: at the zoo's full depth and a tiny width, batch norm over a few
rows after each of ~50 convolutions makes the loss so sensitive to the weights that fp32's
rounding alone (torch against tf, world 1 against world 2, fp32 against fp64) parts the
curves by step 2 (measured: docs/zoo.md). Each small version keeps one of every block its
model has, and agrees to about 1e-7 for 12 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import attrs
import numpy as np


def write_images(directory: Path, rows: int = 512, side: int = 32, seed: int = 0) -> None:
    """``imagenet.npz``, what the classifiers read scaled down: uint8 [rows, side, side, 3]
    images, labels 0..9, brighter for larger labels (something to learn)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=rows)
    images = rng.integers(0, 160, size=(rows, side, side, 3)) + labels[:, None, None, None] * 9
    np.savez(directory / "imagenet.npz", x=images.astype(np.uint8), y=labels)


def write_masks(directory: Path, rows: int = 256, side: int = 16, seed: int = 0) -> None:
    """``masks.npz``, what the U-Net reads scaled down: uint8 [rows, side, side, 3] noise
    with one brighter rectangle each, and its mask [rows, side, side] (1 inside, 0 outside)."""
    rng = np.random.default_rng(seed)
    masks = np.zeros((rows, side, side), np.int64)
    for mask in masks:
        top, left = rng.integers(0, side - side // 4, size=2)
        height, width = rng.integers(side // 8 + 1, side // 2, size=2)
        mask[top : top + height, left : left + width] = 1
    images = rng.integers(0, 128, size=(rows, side, side, 3)) + masks[..., None] * 100
    np.savez(directory / "masks.npz", x=images.astype(np.uint8), y=masks)


@attrs.frozen
class ZooModel:
    """One plan of ``examples/zoo``: its file, the settings of its small version and the
    data that version trains on (written beside the plan, under the name the plan reads)."""

    file: str
    small: tuple[str, ...]
    write_data: Callable[[Path], None]

    @property
    def text(self) -> str:
        return (resources.files("crosstrain.testing") / "zoo_plans" / self.file).read_text(encoding="utf-8")


#: each zoo plan and its small version: a width, 32x32 (U-Net: 16x16) inputs, one repeat of
#: each block kept (``repeat = 0`` leaves the others out), a batch of 32 (batch norm over
#: fewer rows at 1x1 maps parts the frameworks' curves within 12 steps) and a gentle rate
ZOO: dict[str, ZooModel] = {
    "resnet50": ZooModel(
        "resnet50.toml",
        (
            "model.width=0.0625",
            "model.input_shape=[32, 32, 3]",
            "model.layers[7].repeat=1",  # conv2_x: its projection bottleneck and one identity one
            "model.layers[9].repeat=0",
            "model.layers[11].repeat=0",
            "model.layers[13].repeat=0",
            "train.global_batch_size=32",
            "optimizer.lr=0.01",
            "train.precision='fp64'",
        ),
        write_images,
    ),
    "mobilenet_v2": ZooModel(
        "mobilenet_v2.toml",
        (
            "model.width=0.125",
            "model.input_shape=[32, 32, 3]",
            "model.layers[6].repeat=1",  # c24: the first row with a residual block, once
            "model.layers[8].repeat=0",
            "model.layers[10].repeat=0",
            "model.layers[12].repeat=0",
            "model.layers[14].repeat=0",
            "train.global_batch_size=32",
            "optimizer.lr=0.002",
            "train.precision='fp64'",
        ),
        write_images,
    ),
    "unet": ZooModel(
        "unet.toml",
        (
            "model.width=0.0625",
            "model.input_shape=[16, 16, 3]",
            "train.global_batch_size=32",
            "train.precision='fp64'",
        ),
        write_masks,
    ),
}
