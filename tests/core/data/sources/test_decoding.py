"""Decoding a row: OpenCV's exact resize against its reference (Pillow's pixels), a plan's
``antialias`` reaching its rows, and OpenCV missing named before launch."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from crosstrain.core.admission.checks import check_image_files
from crosstrain.core.data.augment import centre_box
from crosstrain.core.data.sources.images import ImageRows, decode_image
from crosstrain.core.errors import PlanError
from crosstrain.core.run.loading import load_datasets
from tests.core.image_files import image_plan, photographs, write_folder

# --------------------------------------------------------------------------- OpenCV's exact resize


def _opencv_reference(path: str, size: tuple[int, int]) -> tuple[np.ndarray, float]:
    """The centre box of Pillow's decode (at the DCT scale its ``draft`` picks), cut at
    whole pixels of that scale and resized by OpenCV's bit-exact bilinear filter; and the
    scale it was decoded at."""
    cv2 = pytest.importorskip("cv2")
    with Image.open(path) as opened:
        width, height = opened.size
        top, left, box_h, box_w = centre_box(height, width, *size)
        opened.draft("RGB", (-(-width * size[1] // box_w), -(-height * size[0] // box_h)))
        decoded = np.asarray(opened.convert("RGB"))
    scale_y, scale_x = decoded.shape[0] / height, decoded.shape[1] / width
    first_row, first_column = round(top * scale_y), round(left * scale_x)
    crop = decoded[
        first_row : max(first_row + 1, round((top + box_h) * scale_y)),
        first_column : max(first_column + 1, round((left + box_w) * scale_x)),
    ]
    return cv2.resize(crop, size[::-1], interpolation=cv2.INTER_LINEAR_EXACT), scale_x


def test_without_antialias_a_row_is_pillow_s_pixels_resized_by_opencv_exactly(tmp_path: Path) -> None:
    """OpenCV decodes what Pillow decodes (one libjpeg-turbo), at each DCT scale: a 200x150
    JPEG read at 1/4, the photographs at 1/2 (one of them a scale of 28/55: its box rounded
    to whole pixels) and a PNG at full scale."""
    large = tmp_path / "large.jpg"
    gradient = np.linspace(0, 255, 200 * 150 * 3).reshape(150, 200, 3).astype(np.uint8)
    Image.fromarray(gradient).save(large, quality=90)
    png = tmp_path / "small.png"
    Image.fromarray(gradient[40:90, 20:90]).save(png)
    scales = []
    for path in [str(large), str(png), *photographs(tmp_path, 4)]:
        expected, scale = _opencv_reference(path, (16, 24))
        scales.append(scale)
        assert np.array_equal(decode_image(path, (16, 24), None, None, antialias=False), expected), path
    assert scales[:2] == [1 / 4, 1.0] and {0.5, 28 / 55} <= set(scales)


def test_a_plan_s_antialias_reaches_its_training_and_eval_rows(tmp_path: Path) -> None:
    write_folder(tmp_path / "photos")
    datasets = load_datasets(image_plan(tmp_path, 'path = "photos"\nantialias = false'))
    assert datasets.eval is not None
    for rows in (datasets.train.x, datasets.eval.x):
        raw = getattr(rows, "raw", rows)  # scaled rows wrap the image rows
        assert isinstance(raw, ImageRows) and raw.antialias is False


def test_without_opencv_antialias_false_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_folder(tmp_path / "photos")
    plan = image_plan(tmp_path, 'path = "photos"\nantialias = false')
    monkeypatch.setitem(sys.modules, "cv2", None)  # as if not installed
    with pytest.raises(PlanError, match=r"data\.antialias: .*OpenCV: pip install 'crosstrain\[images\]'"):
        check_image_files(plan, load_datasets(plan))
