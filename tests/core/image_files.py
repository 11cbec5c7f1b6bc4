"""Image files the core tests write: small JPEG and PNG class folders, photographs with
detail a resize shows, and a plan reading them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
from PIL import Image

from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.plan_dicts import structure_plan


def write_image(path: Path, value: int, size: tuple[int, int] = (12, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.full((*size, 3), value, np.uint8)
    pixels[: size[0] // 2, :, 0] = 255 - value  # not one colour: a flip shows
    Image.fromarray(pixels).save(path, quality=95)


def write_folder(root: Path) -> Path:
    for index, name in enumerate(["zebra", "ant", "Bee"]):
        for copy in range(3):
            write_image(root / name / f"{copy}.{'png' if copy % 2 else 'jpg'}", 40 * index + copy)
    return root


def image_plan(tmp_path: Path, data: str, input_shape: str = "[8, 8, 3]") -> Plan:
    text = f"""
[model]
input_shape = {input_shape}
layers = [{{ type = "flatten" }}, {{ type = "dense", units = 3 }}]
[data]
source = "images"
image_size = [8, 8]
{data}
"""
    return structure_plan(tomllib.loads(text), source="plan.toml", base_dir=tmp_path)


def photographs(root: Path, count: int) -> np.ndarray:
    """JPEGs of a few sizes (wider and taller than the output), with detail a resize shows."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        height, width = (45 + 7 * (k % 4), 60 - 5 * (k % 3))
        smooth = np.cumsum(rng.integers(-9, 10, (height, width, 3)), axis=1) % 256
        paths.append(root / f"{k}.jpg")
        Image.fromarray(smooth.astype(np.uint8)).save(paths[-1], quality=90)
    return np.asarray([str(path) for path in paths])
