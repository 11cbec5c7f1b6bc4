"""The augmentation's draws against plain references, bit for bit: the crop boxes, flips,
padded crops and colour jitter (torchvision's uint8 steps), mixup and cutmix."""

from __future__ import annotations

import colorsys
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from crosstrain.core.data.augment import (
    Augmentation,
    color_jitter,
    crop_boxes,
    flips,
    jitter_factors,
    mix_rows,
    mixed_targets,
    mixing,
    pad_offsets,
    shift_hue,
    uniforms,
)
from crosstrain.core.errors import PlanError

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


def _torchvision_jitter(image: np.ndarray, factors: list[float]) -> np.ndarray:
    """torchvision's adjust_brightness, _contrast, _saturation on a uint8 image, in numpy:
    each a blend, clamped, converted back to uint8."""

    def blend(one: np.ndarray, other, ratio: float) -> np.ndarray:
        ratio32 = np.float32(ratio)
        mixed = ratio32 * one.astype(np.float32) + (np.float32(1) - ratio32) * other
        return np.clip(mixed, 0, 255).astype(np.uint8)

    def grey(rgb: np.ndarray) -> np.ndarray:
        r, g, b = (rgb[..., k].astype(np.float32) for k in range(3))
        return (np.float32(0.2989) * r + np.float32(0.587) * g + np.float32(0.114) * b).astype(np.uint8)

    image = blend(image, np.float32(0), factors[0])
    image = blend(image, np.float32(grey(image).astype(np.float32).mean(dtype=np.float32)), factors[1])
    return blend(image, grey(image)[..., None].astype(np.float32), factors[2])


def test_color_jitter_equals_torchvision_s_uint8_steps() -> None:
    rows = np.arange(40, dtype=np.int64)
    draws = uniforms(3, 2, rows)
    factors = jitter_factors(draws, (0.4, 0.2, 0.6))
    expected = [
        [0.6 + 0.8 * _draw(3, 2, row, 25), 0.8 + 0.4 * _draw(3, 2, row, 26), 0.4 + 1.2 * _draw(3, 2, row, 27)]
        for row in range(40)
    ]
    assert np.allclose(factors, expected, rtol=0, atol=1e-15)
    images = np.random.default_rng(1).integers(0, 256, (40, 9, 7, 3), dtype=np.uint8)
    for image, row_factors in zip(images, factors, strict=True):
        assert np.array_equal(color_jitter(image, row_factors), _torchvision_jitter(image, list(row_factors)))


def _colorsys_hue(image: np.ndarray, shift: float) -> np.ndarray:
    """The hue turned pixel by pixel by Python's colorsys, in float64 (rounded, not
    truncated: it is the exact value, where torchvision's steps truncate float32's)."""
    out = np.empty_like(image)
    for index in np.ndindex(image.shape[:2]):
        h, s, v = colorsys.rgb_to_hsv(*(image[index] / 255.0))
        out[index] = np.round(np.array(colorsys.hsv_to_rgb((h + shift) % 1.0, s, v)) * 255.0)
    return out


@pytest.mark.parametrize("shift", [0.0, 0.07, -0.31, 0.5])
def test_a_hue_shift_is_colorsys_s_to_within_a_grey_level_and_keeps_greys(shift: float) -> None:
    image = np.random.default_rng(2).integers(0, 256, (12, 11, 3), dtype=np.uint8)
    image[0] = image[0, :, :1]  # a row of greys: no hue to turn
    turned = shift_hue(image, shift)
    assert np.abs(turned.astype(int) - _colorsys_hue(image, shift)).max() <= 1
    assert np.array_equal(turned[0], image[0])


def test_hue_jitter_draws_its_shift_from_draw_32_and_runs_after_saturation() -> None:
    rows = np.arange(6, dtype=np.int64)
    factors = jitter_factors(uniforms(3, 2, rows), (0.4, 0.2, 0.6, 0.1))
    assert np.allclose(
        factors[:, 3], [-0.1 + 0.2 * _draw(3, 2, row, 32) for row in range(6)], rtol=0, atol=1e-15
    )
    image = np.random.default_rng(4).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    expected = shift_hue(color_jitter(image, factors[0, :3]), float(factors[0, 3]))
    assert np.array_equal(color_jitter(image, factors[0]), expected)
    for strengths in ([0.4, 0.4, 0.4, 0.6], [0.4, 0.4], [0.4, 0.4, 0.4, -0.1]):
        with pytest.raises(ValueError, match="'color_jitter' must be"):
            Augmentation(color_jitter=tuple(strengths))


# --------------------------------------------------------------------------- mixup, cutmix


def _reference_mixing(seed: int, epoch: int, row: int, train_rows: int, size: tuple[int, int], alphas):
    """One row's partner, weight and cutmix box, by hand: the hash's draws 28..31, the Beta
    weight as scipy.stats' quantile of draw 33, torchvision's CutMix box."""
    mixup_alpha, cutmix_alpha = alphas
    partner = math.floor(_draw(seed, epoch, row, 28) * train_rows)
    cut = _draw(seed, epoch, row, 29) < 0.5 if mixup_alpha and cutmix_alpha else bool(cutmix_alpha)
    alpha = cutmix_alpha if cut else mixup_alpha
    lam = float(scipy.stats.beta(alpha, alpha).ppf(_draw(seed, epoch, row, 33)))
    if not cut:
        return partner, lam, None
    height, width = size
    centre_y = math.floor(_draw(seed, epoch, row, 30) * height)
    centre_x = math.floor(_draw(seed, epoch, row, 31) * width)
    half = 0.5 * math.sqrt(1.0 - lam)
    half_h, half_w = int(half * height), int(half * width)
    box = (
        max(centre_y - half_h, 0),
        max(centre_x - half_w, 0),
        min(centre_y + half_h, height),
        min(centre_x + half_w, width),
    )
    return partner, 1.0 - (box[2] - box[0]) * (box[3] - box[1]) / (height * width), box


@pytest.mark.parametrize("alphas", [(0.4, 1.0), (0.2, 0.0), (0.0, 1.0)])
def test_mixup_and_cutmix_draws_equal_a_plain_reference(alphas) -> None:
    augmentation = Augmentation(mixup=alphas[0], cutmix=alphas[1])
    rows = np.arange(40, 80)
    plan = mixing(augmentation, 3, 2, rows, 500, (16, 12))
    for k, row in enumerate(rows):
        partner, lam, box = _reference_mixing(3, 2, int(row), 500, (16, 12), alphas)
        assert plan.partners[k] == partner and bool(plan.cut[k]) == (box is not None)
        assert plan.lam[k] == pytest.approx(lam, abs=1e-12)
        if box is not None:
            assert tuple(plan.boxes[k]) == box


def test_mixed_rows_and_targets_are_the_pairs_blended_or_pasted() -> None:
    rng = np.random.default_rng(0)
    rows, partners = (rng.integers(0, 256, (6, 16, 12, 3)).astype(np.uint8) for _ in range(2))
    plan = mixing(Augmentation(mixup=0.4, cutmix=1.0), 1, 0, np.arange(6), 50, (16, 12))
    assert plan.cut.any() and not plan.cut.all()
    mixed = mix_rows(rows, partners, plan)
    for k in range(6):
        if plan.cut[k]:
            top, left, bottom, right = plan.boxes[k]
            expected = rows[k].copy()
            expected[top:bottom, left:right] = partners[k, top:bottom, left:right]
        else:
            lam = np.float32(plan.lam[k])
            blend = lam * rows[k].astype(np.float32) + (np.float32(1) - lam) * partners[k].astype(np.float32)
            expected = np.floor(blend + np.float32(0.5)).astype(np.uint8)
        assert np.array_equal(mixed[k], expected)
    labels = np.arange(6) % 3
    targets = mixed_targets(labels, labels[::-1], plan)
    assert targets.dtype == np.float32 and targets.shape == (6, 3)
    assert np.array_equal(targets[:, 2], plan.lam.astype(np.float32))


@pytest.mark.parametrize(
    ("setting", "found"),
    [
        ('metrics = ["loss"]\nloss = { name = "mse" }', "data.augment.mixup: mixes each row's class label"),
        ("", "data.augment transforms images"),
    ],
)
def test_mixing_needs_an_image_source_and_class_labels(tmp_path: Path, setting: str, found: str) -> None:
    from crosstrain.core.spec.planfile import load_plan

    source = 'source = "images"\npath = "photos"\nimage_size = [8, 8]' if setting else 'source = "digits"'
    (tmp_path / "plan.toml").write_text(
        f"{setting}\n"
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        f"[data]\n{source}\n[data.augment]\nmixup = 0.2\n"
    )
    with pytest.raises(PlanError, match=found):
        load_plan(tmp_path / "plan.toml")
