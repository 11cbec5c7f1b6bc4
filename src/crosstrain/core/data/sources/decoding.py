"""Decoding image rows: :func:`decode_image` (one file to one uint8 row, boxed, resized and
augmented as its draws say) and :func:`decode_rows` (a chunk of them, what a worker of
:mod:`crosstrain.core.data.sources.pool` runs). Pillow decodes and resizes (antialiased); with
``data.antialias = false`` OpenCV decodes (the same libjpeg-turbo, the same pixels) and
resizes with its bit-exact bilinear filter. Nothing here starts a process.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from crosstrain.core.data.augment import (
    Augmentation,
    centre_box,
    color_jitter,
    crop_boxes,
    flips,
    jitter_factors,
    pad_crop,
    pad_offsets,
)
from crosstrain.core.errors import InputError

if TYPE_CHECKING:
    from PIL import Image

IMAGES_EXTRA = "pip install 'crosstrain[images]'"


def pillow() -> Any:
    """Pillow's Image module, or one line naming the extra that brings it."""
    try:
        from PIL import Image
    except ImportError:
        raise InputError(f"data.source = 'images' needs Pillow: {IMAGES_EXTRA}") from None
    return Image


# --------------------------------------------------------------------------- one row


#: what Pillow raises for a file it cannot read as an image
UNDECODABLE = (OSError, ValueError, SyntaxError)
#: a decoded cache's pixels file (core/data/sources/cache.py writes it)
CACHE_PIXELS = "pixels.u8"
#: where rows lie in a decoded cache: its folder, and per row (first byte, height, width)
Cached = tuple[str, np.ndarray]


def opencv() -> Any:
    """OpenCV's module, set to one thread (each worker is one core's worth), or one line
    naming the extra that brings it."""
    try:
        import cv2
    except ImportError:
        raise InputError(f"data.antialias = false resizes with OpenCV: {IMAGES_EXTRA}") from None
    cv2.setNumThreads(1)
    return cv2


@attrs.frozen(eq=False)
class FileRows:
    """Rows to decode: their files, the output size, the augmentation and each row's draws
    (None: the evaluation's centre box), where a decoded cache holds their pixels, and how
    they are resized (``antialias``: Pillow's filter, else OpenCV's exact one)."""

    paths: list[str]
    size: tuple[int, int]
    augmentation: Augmentation | None = None
    draws: np.ndarray | None = None
    cached: Cached | None = None
    antialias: bool = True

    def part(self, start: int, stop: int) -> FileRows:
        """Rows ``start`` to ``stop``: what one worker's chunk carries."""
        return attrs.evolve(
            self,
            paths=self.paths[start:stop],
            draws=None if self.draws is None else self.draws[start:stop],
            cached=None if self.cached is None else (self.cached[0], self.cached[1][start:stop]),
        )


def decode_image(
    path: str,
    size: tuple[int, int],
    augmentation: Augmentation | None,
    draws: np.ndarray | None,
    antialias: bool = True,
) -> np.ndarray:
    """One file as uint8 ``(h, w, 3)``: boxed, resized, padded-cropped and flipped as
    ``augmentation`` and this row's ``draws`` say (None: the centre box only); resized by
    Pillow's antialiased bilinear filter, or without ``antialias`` by OpenCV's bit-exact
    bilinear interpolation."""
    row = np.empty((1, *size, 3), np.uint8)
    one_draw = None if draws is None else draws[None]
    failed = _decode_into(FileRows([path], size, augmentation, one_draw, None, antialias), row)
    if failed is not None:
        raise failed[1]
    return np.asarray(row[0])


def decode_rows(rows: FileRows, out: np.ndarray) -> str | None:
    """``out[k]`` = row k decoded (its pixels read from a decoded cache where ``rows.cached``
    says where they lie); the first file that does not decode stops the chunk and is named
    in the line returned (None when every row decoded)."""
    failed = _decode_into(rows, out)
    return None if failed is None else f"cannot decode image {rows.paths[failed[0]]}: {failed[1]}"


def _decode_into(rows: FileRows, out: np.ndarray) -> tuple[int, Exception] | None:
    """The rows decoded into ``out``, their draws turned into boxes, offsets and flips for
    all of them at once (numpy's cost is per call, not per row: a row at a time, the crop
    boxes alone took an eighth of a row's time); the first row that failed and its error."""
    paths, size, draws, cached, antialias = rows.paths, rows.size, rows.draws, rows.cached, rows.antialias
    if cached is not None:
        sizes = cached[1][:, 1:]
    else:
        sizes = np.zeros((len(paths), 2), np.int64)  # (height, width): the headers only
        jpeg = np.zeros(len(paths), bool)
        for k, path in enumerate(paths):
            try:
                with pillow().open(path) as opened:
                    sizes[k], jpeg[k] = opened.size[::-1], opened.format == "JPEG"
            except UNDECODABLE as error:
                return k, error
    augmented = rows.augmentation if draws is not None else None
    boxes = _boxes(sizes, size, augmented, draws)
    for k, path in enumerate(paths):
        try:
            if cached is not None:
                _resize_cached(cached[0], cached[1][k], boxes[k], out[k], antialias)
            elif antialias:
                out[k] = _resized(path, boxes[k], size)
            else:
                _resize_exact(path, bool(jpeg[k]), sizes[k], boxes[k], out[k])
        except UNDECODABLE as error:
            return k, error
    if augmented is not None and draws is not None:
        _augment(out[: len(paths)], augmented, draws)
    return None


def _boxes(
    sizes: np.ndarray, size: tuple[int, int], augmentation: Augmentation | None, draws: np.ndarray | None
) -> np.ndarray:
    """int64 [rows, 4] (top, left, height, width): each row's random resized crop, or the
    evaluation's centre box."""
    if augmentation is not None and augmentation.crop_scale is not None and draws is not None:
        return crop_boxes(draws, sizes, augmentation.crop_scale)
    return np.array([centre_box(int(h), int(w), *size) for h, w in sizes], np.int64).reshape(-1, 4)


def _resized(path: str, box: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The file's ``box`` (top, left, height, width) resized to ``size``, uint8 HWC."""
    image = pillow()
    out_h, out_w = size
    top, left, box_h, box_w = (int(v) for v in box)
    with image.open(path) as opened:
        width, height = opened.size
        decoded = _draft(opened, (width, height), box_h, box_w, size)
        scale_x, scale_y = decoded.size[0] / width, decoded.size[1] / height
        resized = decoded.convert("RGB").resize(
            (out_w, out_h),
            image.Resampling.BILINEAR,
            box=(left * scale_x, top * scale_y, (left + box_w) * scale_x, (top + box_h) * scale_y),
        )
        return np.asarray(resized, np.uint8)


def _resize_exact(path: str, jpeg: bool, full: np.ndarray, box: np.ndarray, out: np.ndarray) -> None:
    """The file's ``box`` (top, left, height, width) resized into ``out`` by OpenCV: decoded
    by the libjpeg-turbo Pillow uses too (the same pixels), at the DCT scale Pillow's
    ``draft`` picks; the box, scaled with it, rounded to whole pixels."""
    cv2 = opencv()
    height, width = (int(v) for v in full)
    top, left, box_h, box_w = (int(v) for v in box)
    reduction = _dct_reduction(width, height, box_h, box_w, out.shape[:2]) if jpeg else 1
    encoded = np.fromfile(path, np.uint8)
    decoded = cv2.imdecode(encoded, _REDUCED_READS[reduction])
    if decoded is None:
        raise ValueError("OpenCV cannot decode it (damaged or cut short)")
    scale_y, scale_x = decoded.shape[0] / height, decoded.shape[1] / width
    _resize_into(cv2, decoded[_scaled_span(top, box_h, scale_y), _scaled_span(left, box_w, scale_x)], out)


def _scaled_span(start: int, length: int, scale: float) -> slice:
    """Pixels ``start`` to ``start + length`` of the full image, at ``scale``: rounded to whole
    pixels, at least one."""
    first = round(start * scale)
    return slice(first, max(first + 1, round((start + length) * scale)))


def _resize_into(cv2: Any, pixels: np.ndarray, out: np.ndarray) -> None:
    """``pixels`` (uint8 HWC) resized into ``out`` by OpenCV's bit-exact bilinear filter."""
    cv2.resize(pixels, (out.shape[1], out.shape[0]), dst=out, interpolation=cv2.INTER_LINEAR_EXACT)


def _dct_reduction(width: int, height: int, box_h: int, box_w: int, size: tuple[int, ...]) -> int:
    """The DCT scale (1, 2, 4, 8) Pillow's ``draft`` picks for the box's output pixels."""
    needed = _draft_size(width, height, box_h, box_w, size)
    scale = min(width // needed[0], height // needed[1])
    return next((denominator for denominator in (8, 4, 2) if scale >= denominator), 1)


#: OpenCV's read flags per DCT reduction: RGB (not its usual BGR), three channels
_REDUCED_READS = {1: 256, 2: 256 | 16, 4: 256 | 32, 8: 256 | 64}  # IMREAD_COLOR_RGB | IMREAD_REDUCED_*


#: each process's maps of the caches it read (folder -> the pixels file, read-only)
_CACHE_MAPS: dict[str, np.ndarray] = {}


def _cached_pixels(folder: str, entry: np.ndarray) -> np.ndarray:
    """A cached image's pixels (first byte, height, width: ``entry``), uint8 HWC over the
    cache's memory map (no copy)."""
    pixels = _CACHE_MAPS.get(folder)
    if pixels is None:
        pixels = _CACHE_MAPS[folder] = np.memmap(os.path.join(folder, CACHE_PIXELS), np.uint8, mode="r")
    start, height, width = (int(v) for v in entry)
    return pixels[start : start + height * width * 3].reshape(height, width, 3)


def _resize_cached(folder: str, entry: np.ndarray, box: np.ndarray, out: np.ndarray, antialias: bool) -> None:
    """A cached image's ``box`` (top, left, height, width) resized into ``out``."""
    pixels = _cached_pixels(folder, entry)
    top, left, box_h, box_w = (int(v) for v in box)
    if not antialias:
        _resize_into(opencv(), pixels[top : top + box_h, left : left + box_w], out)
        return
    image = pillow()
    decoded = image.frombuffer("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGB", 0, 1)
    box_edges = (left, top, left + box_w, top + box_h)
    resized = decoded.resize((out.shape[1], out.shape[0]), image.Resampling.BILINEAR, box=box_edges)
    out[...] = np.asarray(resized, np.uint8)


def _augment(rows: np.ndarray, augmentation: Augmentation, draws: np.ndarray) -> None:
    """The host's steps after the resize, in place, in their order: the padded crop, the
    flip, the colour jitter."""
    if augmentation.pad_crop:
        offsets = pad_offsets(draws, augmentation.pad_crop)
        for k in range(len(rows)):
            rows[k] = pad_crop(rows[k], augmentation.pad_crop, offsets[k])
    if augmentation.flip:
        mirrored = flips(draws)
        rows[mirrored] = rows[mirrored, :, ::-1]
    if augmentation.color_jitter is not None and any(augmentation.color_jitter):
        factors = jitter_factors(draws, augmentation.color_jitter)
        for k in range(len(rows)):
            rows[k] = color_jitter(rows[k], factors[k])


def _draft(
    opened: Image.Image, full: tuple[int, int], box_h: int, box_w: int, size: tuple[int, int]
) -> Image.Image:
    """A JPEG set to decode at the smallest of its DCT scales (1/1, 1/2, 1/4, 1/8) at which
    the box still has the output's pixels; other formats as they are."""
    if opened.format == "JPEG":
        opened.draft("RGB", _draft_size(*full, box_h, box_w, size))
    return opened


def _draft_size(width: int, height: int, box_h: int, box_w: int, size: tuple[int, ...]) -> tuple[int, int]:
    """The whole image's (width, height) at which the box has the output's pixels: what a
    reduced JPEG decode must keep."""
    return -(-width * size[1] // box_w), -(-height * size[0] // box_h)
