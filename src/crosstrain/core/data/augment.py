"""Augmentation whose every random draw is a counter-based hash, no RNG state (the image
transforms here; token windows' offsets: :func:`crosstrain.core.data.sources.text.window_offsets`).

Draw ``k`` of dataset row ``row`` in epoch ``epoch`` is a hash of (seed, epoch, row, k)
(the mix of :mod:`crosstrain.core.model.dropout`), so the same row gets the same crop and flip
in every framework, at every world size, whichever process decodes it, and after a resume
mid-epoch: nothing depends on the order rows are read in. Draws are uniform in [0, 1)
with 24 bits (exact in float64); ``floor(u * n)`` is an integer in 0..n-1.

The draw numbers are fixed (:data:`CROP_DRAWS` ...), so adding a transform never moves the
draws of another. Geometric work (crop boxes, flips, padded crops) happens on the host,
before the rows are copied: fewer bytes to move.

- random resized crop (``crop_scale = [lo, hi]``): torchvision's ``RandomResizedCrop``
  rule. Up to 10 tries, each an area fraction uniform in [lo, hi] (draw 2t) and an aspect
  ratio log-uniform in [3/4, 4/3] (draw 2t+1); the first box that fits the image wins, at
  a top/left offset uniform over where it fits (draws 20, 21). If no try fits: the
  centre crop of the whole image, its aspect ratio clamped to [3/4, 4/3].
- flip (``flip = true``): mirrored left-right when draw 22 < 1/2.
- padded crop (``pad_crop = N``): zero-padded by N on every side, then the image's size
  cut at offsets floor(u * (2N + 1)) down (draw 23) and right (draw 24).
- color jitter (``color_jitter = [b, c, s]`` or ``[b, c, s, h]``): brightness, contrast and
  saturation factors uniform in [max(0, 1 - x), 1 + x] (draws 25, 26, 27) and a hue shift
  uniform in [-h, h] (draw 32), applied in that order on the host as torchvision applies
  them to uint8 images (each a blend clamped to 0..255 and truncated to uint8; contrast
  blends with the mean grey level, saturation with each pixel's grey; the hue turns the
  pixels to HSV in float32, shifts h, and back).
- mixup and cutmix (``mixup = a``, ``cutmix = a``: a Beta(a, a) mixing weight): each row is
  mixed with a partner row of the training set, floor(u * rows) (draw 28) — any row, not
  one of the same batch, so the pair is the same whichever process reads the row, at any
  world size and after a resume (the partner is decoded with its own draws). With both on,
  draw 29 < 1/2 picks cutmix. The weight lam is Beta(a, a)'s quantile of draw 33 (scipy's
  ``betaincinv``, the inverse regularized incomplete beta function). Mixup: ``lam * row +
  (1 - lam) * partner`` rounded to the nearest grey level (the rows stay uint8). Cutmix
  (torchvision's rule): a box of half-sides ``floor(0.5 * sqrt(1 - lam) * side)`` around
  the centre (floor(u * height), floor(u * width)) (draws 30, 31), clipped to the image, is
  the partner's; lam becomes the share of the row left. The targets are (label, partner's
  label, lam): the loss is ``lam * loss(label) + (1 - lam) * loss(partner's label)``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from crosstrain.core.hashing import MASK32, mix

#: a domain tag mixed into the state, so no augmentation draw equals a dropout draw
AUGMENT_TAG = 0x41554731
CROP_TRIES = 10
CROP_DRAWS = tuple(range(2 * CROP_TRIES))  # (area, ratio) per try
TOP_DRAW, LEFT_DRAW = 20, 21
FLIP_DRAW = 22
PAD_TOP_DRAW, PAD_LEFT_DRAW = 23, 24
JITTER_DRAWS = (25, 26, 27)  # brightness, contrast, saturation
PARTNER_DRAW, CUTMIX_DRAW = 28, 29
CUT_CENTRE_DRAWS = (30, 31)  # (down, right)
HUE_DRAW = 32
LAM_DRAW = 33  # mixup's and cutmix's Beta weight, by its quantile
DRAWS = 34
#: ITU-R 601 luma weights of a grey level (torchvision's rgb_to_grayscale)
LUMA = (0.2989, 0.587, 0.114)
#: torchvision's aspect-ratio range of a random resized crop
RATIO = (3.0 / 4.0, 4.0 / 3.0)
UNIFORM_BITS = 24


def _check_crop_scale(
    instance: Any, attribute: attrs.Attribute[Any], value: tuple[float, float] | None
) -> None:
    if value is not None and not 0.0 < value[0] <= value[1] <= 1.0:
        raise ValueError(f"'crop_scale' must be [lo, hi] with 0 < lo <= hi <= 1, got {list(value)}")


def _check_jitter(instance: Any, attribute: attrs.Attribute[Any], value: tuple[float, ...] | None) -> None:
    if value is None:
        return
    if len(value) not in (3, 4) or any(strength < 0 for strength in value) or value[3:4] > (0.5,):
        raise ValueError(
            "'color_jitter' must be [brightness, contrast, saturation] or [brightness, contrast, "
            f"saturation, hue], each >= 0 (hue <= 0.5), got {list(value)}"
        )


def _check_pad(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise ValueError(f"'pad_crop' must be >= 0, got {value}")


def _check_alpha(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(
            f"'{attribute.name}' must be >= 0 (a Beta distribution's alpha; 0: off), got {value}"
        )


@attrs.frozen
class Augmentation:
    """What ``[data.augment]`` asks of a training row (None, False, 0: not done)."""

    crop_scale: tuple[float, float] | None = attrs.field(default=None, validator=_check_crop_scale)
    flip: bool = False
    pad_crop: int = attrs.field(default=0, validator=_check_pad)
    color_jitter: tuple[float, ...] | None = attrs.field(default=None, validator=_check_jitter)
    #: token sources: each training window starts 0..sequence_length-1 tokens later, drawn
    #: anew every epoch (:func:`crosstrain.core.data.sources.text.window_offsets`)
    window_offset: bool = False
    #: images: the alpha of mixup's and cutmix's Beta(alpha, alpha) mixing weight (0: off)
    mixup: float = attrs.field(default=0.0, validator=_check_alpha)
    cutmix: float = attrs.field(default=0.0, validator=_check_alpha)

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    @property
    def transforms_images(self) -> bool:
        jitters = self.color_jitter is not None and any(self.color_jitter)
        return self.crop_scale is not None or self.flip or self.pad_crop > 0 or jitters or self.mixes

    @property
    def is_identity(self) -> bool:
        return not self.transforms_images and not self.window_offset


def uniforms(seed: int, epoch: int, rows: np.ndarray, count: int = DRAWS) -> np.ndarray:
    """float64 [len(rows), count]: draw k of each row, uniform in [0, 1) (24 bits)."""
    state = mix(np.asarray(seed & MASK32, np.int64) ^ AUGMENT_TAG)
    state = mix(state ^ np.int64(epoch & MASK32))
    per_row = mix(state ^ (np.asarray(rows, np.int64)[:, None] & MASK32))
    hashed = mix(per_row ^ np.arange(count, dtype=np.int64)[None, :])
    return (hashed >> (32 - UNIFORM_BITS)).astype(np.float64) / float(1 << UNIFORM_BITS)


def below(u: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """An integer uniform in 0..n-1 from a uniform in [0, 1)."""
    return np.asarray(np.floor(u * n), np.int64)


def crop_boxes(draws: np.ndarray, sizes: np.ndarray, scale: tuple[float, float]) -> np.ndarray:
    """int64 [rows, 4] (top, left, height, width) of each row's random resized crop;
    ``draws`` from :func:`uniforms`, ``sizes`` [rows, 2] each image's (height, width)."""
    height, width = sizes[:, 0].astype(np.int64), sizes[:, 1].astype(np.int64)
    area = (height * width).astype(np.float64)
    log_low, log_high = math.log(RATIO[0]), math.log(RATIO[1])
    found = np.zeros(len(sizes), bool)
    box_h, box_w = _centre_fallback(height, width)
    for attempt in range(CROP_TRIES):
        target = area * (scale[0] + (scale[1] - scale[0]) * draws[:, CROP_DRAWS[2 * attempt]])
        ratio = np.exp(log_low + (log_high - log_low) * draws[:, CROP_DRAWS[2 * attempt + 1]])
        w = np.round(np.sqrt(target * ratio)).astype(np.int64)
        h = np.round(np.sqrt(target / ratio)).astype(np.int64)
        fits = ~found & (w > 0) & (w <= width) & (h > 0) & (h <= height)
        box_h, box_w = np.where(fits, h, box_h), np.where(fits, w, box_w)
        found |= fits
    top = np.where(found, below(draws[:, TOP_DRAW], height - box_h + 1), (height - box_h) // 2)
    left = np.where(found, below(draws[:, LEFT_DRAW], width - box_w + 1), (width - box_w) // 2)
    return np.stack([top, left, box_h, box_w], axis=1)


def _centre_fallback(height: np.ndarray, width: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's box when no try fits: the whole image, its ratio clamped to RATIO."""
    in_ratio = width / height
    narrow, wide = in_ratio < RATIO[0], in_ratio > RATIO[1]
    box_w = np.where(narrow, width, np.where(wide, np.round(height * RATIO[1]).astype(np.int64), width))
    box_h = np.where(narrow, np.round(width / RATIO[0]).astype(np.int64), height)
    return box_h.astype(np.int64), box_w.astype(np.int64)


def centre_box(height: int, width: int, out_height: int, out_width: int) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the largest centred box with the output's aspect ratio:
    what evaluation (and training without ``crop_scale``) resizes to the image size."""
    if width * out_height > height * out_width:  # wider than the output: cut the sides
        box_h, box_w = height, max(1, round(height * out_width / out_height))
    else:
        box_h, box_w = max(1, round(width * out_height / out_width)), width
    return (height - box_h) // 2, (width - box_w) // 2, box_h, box_w


def flips(draws: np.ndarray) -> np.ndarray:
    """bool [rows]: which rows are mirrored left-right."""
    return np.asarray(draws[:, FLIP_DRAW] < 0.5)


def pad_offsets(draws: np.ndarray, pad: int) -> np.ndarray:
    """int64 [rows, 2]: where each row's crop starts in its image padded by ``pad``."""
    return np.stack(
        [below(draws[:, PAD_TOP_DRAW], 2 * pad + 1), below(draws[:, PAD_LEFT_DRAW], 2 * pad + 1)], axis=1
    )


def pad_crop(image: np.ndarray, pad: int, offset: np.ndarray) -> np.ndarray:
    """The image (HWC) zero-padded by ``pad``, cut back to its size at ``offset``."""
    height, width = image.shape[:2]
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    top, left = int(offset[0]), int(offset[1])
    return padded[top : top + height, left : left + width]


def jitter_factors(draws: np.ndarray, strengths: tuple[float, ...]) -> np.ndarray:
    """float64 [rows, 3 or 4]: each row's brightness, contrast and saturation factors, and
    with a hue strength its hue shift."""
    columns = []
    for draw, strength in zip(JITTER_DRAWS, strengths[:3], strict=True):
        low, high = max(0.0, 1.0 - strength), 1.0 + strength
        columns.append(low + (high - low) * draws[:, draw])
    for strength in strengths[3:]:
        columns.append(-strength + 2.0 * strength * draws[:, HUE_DRAW])
    return np.stack(columns, axis=1)


def color_jitter(image: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """A uint8 HWC image's brightness, contrast and saturation changed by ``factors`` (and
    its hue shifted by a fourth). Each of the first three is torchvision's step on uint8
    images, ``ratio * image + (1 - ratio) * other`` clamped to 0..255 and truncated; kept in
    float32 between the steps (their values are whole numbers: the floor is the
    truncation), one pass of numpy each."""
    brightness, contrast, saturation = (np.float32(factor) for factor in factors[:3])
    pixels = image.astype(np.float32)
    pixels *= brightness
    _clamp_and_truncate(pixels)
    _blend(pixels, np.float32(grey(pixels).mean(dtype=np.float32)), contrast)
    _blend(pixels, grey(pixels)[..., None], saturation)
    jittered = pixels.astype(np.uint8)
    return jittered if len(factors) < 4 else shift_hue(jittered, float(factors[3]))


#: which of (v, p, q, t) is red, green and blue in each sixth of the hue circle
_SEXTANTS = np.array([[0, 2, 1, 1, 3, 0], [3, 0, 0, 2, 1, 1], [1, 1, 3, 0, 0, 2]])


def shift_hue(image: np.ndarray, shift: float) -> np.ndarray:
    """A uint8 HWC image with its hue turned by ``shift`` (of a full turn), as torchvision's
    ``adjust_hue`` turns a uint8 image: to float32 in [0, 1], to HSV (Pillow's formulas), h
    plus the shift modulo 1, back to RGB, times 255.999 truncated to uint8: float32
    throughout, each operation in torchvision's order and precision."""
    one = np.float32(1.0)
    planes = np.moveaxis(image, -1, 0).astype(np.float32)  # channels first: contiguous planes
    planes *= np.float32(1.0 / 255.0)
    red, green, blue = planes
    value = np.maximum(np.maximum(red, green), blue)
    low = np.minimum(np.minimum(red, green), blue)
    grey_pixel = value == low
    spread = value - low
    saturation = spread / np.where(grey_pixel, one, value)
    red_c, green_c, blue_c = (value - planes) / np.where(grey_pixel, one, spread)
    not_red, is_green = value != red, value == green
    hue = (blue_c - green_c) * ~not_red
    hue += (red_c + np.float32(2.0) - blue_c) * (is_green & not_red)
    hue += (green_c + np.float32(4.0) - red_c) * (not_red & ~is_green)
    hue *= np.float32(1.0 / 6.0)
    hue += one
    np.fmod(hue, one, out=hue)
    hue += np.float32(shift)
    np.remainder(hue, one, out=hue)
    hue *= np.float32(6.0)  # from here on, sixths of a turn
    sextant = np.floor(hue)
    hue -= sextant  # the fraction into the sextant
    s_f = saturation * hue
    one_minus_s = one - saturation
    vpqt = np.empty((4, *value.shape), np.float32)
    vpqt[0] = value
    np.clip(one_minus_s * value, 0.0, 1.0, out=vpqt[1])
    np.clip((one - s_f) * value, 0.0, 1.0, out=vpqt[2])
    np.clip((s_f + one_minus_s) * value, 0.0, 1.0, out=vpqt[3])
    chosen = _SEXTANTS[:, np.remainder(sextant.astype(np.int32), 6)]  # [3, h, w]
    rgb = np.take_along_axis(vpqt, chosen, axis=0)
    rgb *= np.float32(255.999)
    return np.moveaxis(rgb.astype(np.uint8), 0, -1)


def grey(pixels: np.ndarray) -> np.ndarray:
    """float32 HW: each pixel's grey level, truncated (torchvision's rgb_to_grayscale)."""
    values = pixels.astype(np.float32, copy=False)
    weights = [np.float32(weight) for weight in LUMA]
    level = weights[0] * values[..., 0]
    level += weights[1] * values[..., 1]
    level += weights[2] * values[..., 2]
    np.floor(level, out=level)
    return level


def _blend(pixels: np.ndarray, other: np.ndarray | np.float32, ratio: np.float32) -> None:
    """``pixels = ratio * pixels + (1 - ratio) * other``, clamped and truncated, in place."""
    pixels *= ratio
    pixels += (np.float32(1.0) - ratio) * other
    _clamp_and_truncate(pixels)


def _clamp_and_truncate(pixels: np.ndarray) -> None:
    np.clip(pixels, 0.0, 255.0, out=pixels)
    np.floor(pixels, out=pixels)


# --------------------------------------------------------------------------- mixup, cutmix


@attrs.frozen(eq=False)
class Mixing:
    """How each row of a batch is mixed: its partner (a training row), its weight ``lam``
    (the share of the row's own label in the loss) and, for cutmix, the box (top, left,
    bottom, right) pasted from the partner (an empty box: mixup)."""

    partners: np.ndarray  # int64 [rows]
    lam: np.ndarray  # float64 [rows]
    cut: np.ndarray  # bool [rows]
    boxes: np.ndarray  # int64 [rows, 4]


def mixing(
    augmentation: Augmentation,
    seed: int,
    epoch: int,
    rows: np.ndarray,
    train_rows: int,
    size: tuple[int, int],
) -> Mixing:
    """Each of ``rows``' partner, weight and cutmix box in ``epoch`` (images of ``size``)."""
    draws = uniforms(seed, epoch, rows)
    partners = below(draws[:, PARTNER_DRAW], train_rows)
    if augmentation.mixup > 0 and augmentation.cutmix > 0:
        cut = draws[:, CUTMIX_DRAW] < 0.5
    else:
        cut = np.full(len(rows), augmentation.cutmix > 0)
    alphas = np.where(cut, augmentation.cutmix, augmentation.mixup)
    from scipy.special import betaincinv  # here: the decoding workers never mix, nor import it

    lam = np.asarray(betaincinv(alphas, alphas, draws[:, LAM_DRAW]), np.float64)
    height, width = size
    centre_y = below(draws[:, CUT_CENTRE_DRAWS[0]], height)
    centre_x = below(draws[:, CUT_CENTRE_DRAWS[1]], width)
    half = 0.5 * np.sqrt(1.0 - lam)
    half_h, half_w = (half * height).astype(np.int64), (half * width).astype(np.int64)
    boxes = np.stack(
        [
            np.maximum(centre_y - half_h, 0),
            np.maximum(centre_x - half_w, 0),
            np.minimum(centre_y + half_h, height),
            np.minimum(centre_x + half_w, width),
        ],
        axis=1,
    )
    boxes[~cut] = 0
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    lam = np.where(cut, 1.0 - area / float(height * width), lam)
    return Mixing(partners, lam, cut, boxes)


def mix_rows(rows: np.ndarray, partners: np.ndarray, plan: Mixing) -> np.ndarray:
    """uint8 rows [n, h, w, 3] mixed with their partners' rows as ``plan`` says."""
    mixed = np.empty_like(rows)
    for k in range(len(rows)):
        if plan.cut[k]:
            top, left, bottom, right = (int(v) for v in plan.boxes[k])
            mixed[k] = rows[k]
            mixed[k, top:bottom, left:right] = partners[k, top:bottom, left:right]
        else:
            lam = np.float32(plan.lam[k])
            blend = lam * rows[k].astype(np.float32) + (np.float32(1.0) - lam) * partners[k].astype(
                np.float32
            )
            mixed[k] = np.floor(blend + np.float32(0.5)).astype(np.uint8)
    return mixed


def mixed_targets(labels: np.ndarray, partner_labels: np.ndarray, plan: Mixing) -> np.ndarray:
    """float32 [n, 3]: each row's label, its partner's label and the row's weight."""
    return np.stack([labels, partner_labels, plan.lam], axis=1).astype(np.float32)
