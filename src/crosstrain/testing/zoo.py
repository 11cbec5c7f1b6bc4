"""The model zoo (``examples/zoo``) in the conformance suite: each plan as shipped, the
``--set`` settings that scale it down to a run of seconds on a CPU, and the arrays it trains
on there.

The plans are package data (``crosstrain/testing/zoo_plans``), word for word the files of
``examples/zoo`` (a test keeps them equal), so a third party's backend, installed beside
crosstrain from a wheel, runs the zoo through the suite as crosstrain's own backends do.

Why the convolutional networks' small versions train in fp64: at the zoo's full depth and
a tiny width, batch norm over a few rows after each of ~50 convolutions makes the loss so
sensitive to the weights that fp32's rounding alone (torch against tf, world 1 against
world 2, fp32 against fp64) parts the curves by step 2. Each small version keeps one of
every block its model has, and agrees for 12 steps (docs/zoo.md has the numbers).

The transformers (ViT-B/16, GPT-2, the Llama) have no batch norm: their small versions (one
encoder or decoder layer, width 16, sequences of 5 or 16, a few thousand weights) train in
fp32, the precision they are written for, and agree for 12 steps across frameworks and
world sizes (docs/zoo.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
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


def write_tokens(directory: Path, count: int = 4096, vocabulary: int = 64, seed: int = 0) -> None:
    """``tokens.npy``, what the language models read scaled down: ``count`` token ids below
    ``vocabulary``, a repeating pattern with one token in five random (something to learn)."""
    rng = np.random.default_rng(seed)
    pattern = np.arange(count) * 5 % 11 * 3 % vocabulary
    noise = rng.integers(0, vocabulary, size=count)
    np.save(directory / "tokens.npy", np.where(rng.random(count) < 0.2, noise, pattern).astype(np.uint16))


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


#: each zoo plan and its small version. The convolutional networks: a width, 32x32 (U-Net:
#: 16x16) inputs, one repeat of each block kept (``repeat = 0`` leaves the others out), a
#: batch of 32 (batch norm over fewer rows at 1x1 maps parts the frameworks' curves within
#: 12 steps) and a gentle rate, in fp64. The transformers: below.
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
    # the transformers: width 16 (heads that divide it), one layer, 10 classes or a
    # vocabulary of 64, and their own precision, fp32
    "vit_b16": ZooModel(
        "vit_b16.toml",
        (
            "model.width=0.0208333",  # 1/48: 768 -> 16 units, the MLP's 3072 -> 64
            "model.input_shape=[16, 16, 3]",
            "model.layers[0].kernel_size=8",  # 8x8 patches: 4 of them and the class token
            "model.layers[0].strides=8",
            "model.layers[1].target_shape=[4, -1]",
            "model.layers[4].repeat=1",
            "model.blocks.encoder.layers[1].heads=2",
            "model.layers[-1].units=10",
            "schedule.warmup_steps=2",
            "train.global_batch_size=32",
        ),
        partial(write_images, side=16),
    ),
    "gpt2_small": ZooModel(
        "gpt2_small.toml",
        (
            "model.width=0.0208333",  # 1/48: 768 -> 16 units, the MLP's 3072 -> 64
            "model.input_shape=[16]",
            "data.sequence_length=16",
            "data.eval_fraction=0.1",
            "model.layers[0].vocab_size=64",
            "model.layers[-1].units=64",
            "model.layers[3].repeat=1",
            "model.blocks.decoder.layers[1].heads=2",
            "optimizer.lr=0.003",
            "schedule.warmup_steps=2",
            "train.global_batch_size=16",
        ),
        write_tokens,
    ),
    "llama": ZooModel(
        "llama.toml",
        (
            "model.width=0.0078125",  # 1/128: 2048 -> 16 units, the MLP's 5632 -> 44
            "model.input_shape=[16]",
            "data.sequence_length=16",
            "data.eval_fraction=0.1",
            "model.layers[0].vocab_size=64",
            "model.layers[-1].units=64",
            "model.layers[1].repeat=1",
            "model.blocks.decoder.layers[1].heads=4",  # head size 4, on 2 key/value heads
            "model.blocks.decoder.layers[1].kv_heads=2",
            "optimizer.lr=0.003",
            "schedule.warmup_steps=2",
            "train.global_batch_size=16",
        ),
        write_tokens,
    ),
}
