"""The images source without a framework: the augmentation's draws against a plain
reference, the folder and index loaders, and each bad input's one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from crosstrain.core.admission import check_image_files
from crosstrain.core.augment import crop_boxes, flips, pad_offsets, uniforms
from crosstrain.core.convert import structure_plan
from crosstrain.core.data import load_datasets, read_rows
from crosstrain.core.errors import PlanError
from crosstrain.core.plan import Plan
from crosstrain.core.sources.images import ImageRows, read_image_index

# --------------------------------------------------------------------------- the draws, by hand


def _mix(value: int) -> int:
    value ^= value >> 16
    value = (value * 0x7FEB352D) & 0xFFFFFFFF
    value ^= value >> 15
    value = (value * 0x2C1B3C6D) & 0xFFFFFFFF
    return value ^ (value >> 16)


def _draw(seed: int, epoch: int, row: int, k: int) -> float:
    state = _mix(_mix((seed & 0xFFFFFFFF) ^ 0x41554731) ^ epoch)
    return (_mix(_mix(state ^ row) ^ k) >> 8) / float(1 << 24)


def _torchvision_box(seed: int, epoch: int, row: int, height: int, width: int, scale: tuple[float, float]):
    """torchvision's RandomResizedCrop.get_params, its random numbers the hash's draws."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for attempt in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * _draw(seed, epoch, row, 2 * attempt))
        ratio = math.exp(
            log_ratio[0] + (log_ratio[1] - log_ratio[0]) * _draw(seed, epoch, row, 2 * attempt + 1)
        )
        w = round(math.sqrt(target_area * ratio))
        h = round(math.sqrt(target_area / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = math.floor(_draw(seed, epoch, row, 20) * (height - h + 1))
            left = math.floor(_draw(seed, epoch, row, 21) * (width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif in_ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    ("seed", "epoch", "scale"), [(0, 0, (0.08, 1.0)), (7, 3, (0.35, 1.0)), (2**40 + 5, 1, (0.9, 1.0))]
)
def test_augmentation_draws_equal_a_plain_reference_bit_for_bit(seed: int, epoch: int, scale) -> None:
    """Crop boxes (tries, fallback to the centre), flips and padded-crop offsets of rows of
    many sizes, including thin ones no try fits, are the reference's exactly."""
    rows = np.arange(0, 4000, 7, dtype=np.int64)
    rng = np.random.default_rng(seed % 1000)
    sizes = np.stack([rng.integers(1, 600, len(rows)), rng.integers(1, 600, len(rows))], axis=1)
    sizes[::5, 0] = 3  # very wide: the fallback's clamped ratio
    draws = uniforms(seed, epoch, rows)
    boxes = crop_boxes(draws, sizes, scale)
    expected = [
        _torchvision_box(seed, epoch, int(row), int(h), int(w), scale)
        for row, (h, w) in zip(rows, sizes, strict=True)
    ]
    assert boxes.tolist() == [list(box) for box in expected]
    assert flips(draws).tolist() == [_draw(seed, epoch, int(row), 22) < 0.5 for row in rows]
    offsets = [[math.floor(_draw(seed, epoch, int(row), k) * 9) for k in (23, 24)] for row in rows]
    assert pad_offsets(draws, 4).tolist() == offsets


# --------------------------------------------------------------------------- loaders


def _image(path: Path, value: int, size: tuple[int, int] = (12, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.full((*size, 3), value, np.uint8)
    pixels[: size[0] // 2, :, 0] = 255 - value  # not one colour: a flip shows
    Image.fromarray(pixels).save(path, quality=95)


def _folder(root: Path) -> Path:
    for index, name in enumerate(["zebra", "ant", "Bee"]):
        for copy in range(3):
            _image(root / name / f"{copy}.{'png' if copy % 2 else 'jpg'}", 40 * index + copy)
    return root


def _plan(tmp_path: Path, data: str, input_shape: str = "[8, 8, 3]") -> Plan:
    text = f"""
[model]
input_shape = {input_shape}
layers = [{{ type = "flatten" }}, {{ type = "dense", units = 3 }}]
[data]
source = "images"
image_size = [8, 8]
{data}
"""
    import tomllib

    return structure_plan(tomllib.loads(text), source="plan.toml", base_dir=tmp_path)


def test_a_folder_and_its_index_give_the_same_rows_classes_sorted_by_name(tmp_path: Path) -> None:
    root = _folder(tmp_path / "photos")
    index = read_image_index(str(root), "data.path", None)
    assert index.classes == ("Bee", "ant", "zebra")  # by name (code points)
    lines = ["label,path"] + [f"{Path(p).parent.name},{Path(p).relative_to(tmp_path)}" for p in index.paths]
    (tmp_path / "index.csv").write_text("\n".join(lines) + "\n")
    listed = read_image_index(str(tmp_path / "index.csv"), "data.path", None)
    assert listed.paths == index.paths and listed.classes == index.classes
    assert np.array_equal(listed.labels, index.labels)
    assert index.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_rows_decode_to_the_image_size_and_training_rows_are_augmented_per_epoch(tmp_path: Path) -> None:
    _folder(tmp_path / "photos")
    plan = _plan(
        tmp_path, 'path = "photos"\neval_fraction = 0.0\n[data.augment]\nflip = true\ncrop_scale = [0.5, 1.0]'
    )
    train = load_datasets(plan).train
    rows = np.arange(len(train))
    plain = read_rows(train.x, rows)  # no epoch: the centre box
    assert plain.shape == (9, 8, 8, 3) and plain.dtype == np.float32
    first, again, later = (read_rows(train.x, rows, epoch) for epoch in (0, 0, 1))
    assert np.array_equal(first, again) and not np.array_equal(first, later)
    assert isinstance(train.x, ImageRows) and train.x.read(rows[:2], 0).dtype == np.uint8


@pytest.mark.parametrize(
    ("data", "found"),
    [
        ('path = "nowhere"', "data.path: no such folder"),
        ('path = "empty"', "holds no class folders"),
        ('path = "photos_with_empty"', "class folder"),
        ('path = "bad.csv"', "has no column 'label'"),
        ('path = "photos"\neval_path = "other"', "data.eval_path: class 'wolf'"),
    ],
)
def test_a_bad_folder_or_index_is_one_line_naming_it(tmp_path: Path, data: str, found: str) -> None:
    _folder(tmp_path / "photos")
    (tmp_path / "empty").mkdir()
    _folder(tmp_path / "photos_with_empty")
    (tmp_path / "photos_with_empty" / "cat").mkdir()
    (tmp_path / "bad.csv").write_text("path,kind\nphotos/ant/0.jpg,ant\n")
    _image(tmp_path / "other" / "wolf" / "0.png", 3)
    with pytest.raises(PlanError) as raised:
        load_datasets(_plan(tmp_path, data))
    assert found in str(raised.value) and "\n" not in str(raised.value)


def test_an_unreadable_image_and_a_misfit_model_are_named(tmp_path: Path) -> None:
    root = _folder(tmp_path / "photos")
    (root / "ant" / "9.jpg").write_bytes(b"not an image at all")
    plan = _plan(tmp_path, 'path = "photos"')
    with pytest.raises(PlanError, match=r"data\.path: cannot read image .*ant/9\.jpg"):
        check_image_files(plan, load_datasets(plan))
    with pytest.raises(PlanError, match=r"model\.input_shape: images of data\.image_size \[8, 8\]"):
        load_datasets(_plan(tmp_path, 'path = "photos"', input_shape="[64]"))
