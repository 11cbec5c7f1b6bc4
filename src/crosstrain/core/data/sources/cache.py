"""A decoded cache of an image source (``data.cache``), written once by ``crosstrain data
cache PLAN`` and read by every run of the plan instead of the files.

What it saves: a row read from the cache skips the JPEG decode, half of a row's work on the
host (docs/data.md#a-decoded-cache has the numbers). What it holds: every
image of ``data.path`` (and ``data.eval_path``) decoded once at its full size, as Pillow
decodes it, uint8 RGB, one after another in ``pixels.u8``; ``index.json`` lists each file
with its size and modification time (so a changed file makes the cache stale, refused before
launch) and where its pixels start, and their height and width. The augmentation, the resize
and the evaluation's centre box run on the cached pixels as on a decoded file, with one
difference: a file's decode at a reduced JPEG scale (``draft``, taken where the box is at
least twice the output on both sides) is the full decode here.

The cache is about three bytes a pixel (docs/data.md gives a folder's size).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from crosstrain.core.data.sources.decoding import CACHE_PIXELS, UNDECODABLE, pillow
from crosstrain.core.errors import InputError, PlanError

PIXELS_FILE = CACHE_PIXELS
INDEX_FILE = "index.json"
#: files a decoding task writes at once (a task's overhead is a message and a memory map)
_FILES_A_TASK = 64


@attrs.frozen
class CachedRows:
    """Where rows' pixels lie in a cache: the folder, and per row its first byte, height and
    width (int64 [rows, 3])."""

    folder: str
    entries: np.ndarray

    def take(self, indices: np.ndarray) -> CachedRows:
        return CachedRows(self.folder, self.entries[indices])


def file_stamp(path: str) -> tuple[int, int]:
    """A file's size and modification time (ns): a changed file is a stale entry."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def write_cache(folder: Path, paths: Sequence[str], workers: int) -> int:
    """Decode every file of ``paths`` into ``folder`` (replacing a cache there); return the
    bytes of pixels written. The cache is written in a temporary folder beside ``folder`` and
    moved into it once whole: a file that does not decode (an InputError naming it), Ctrl-C
    or a full disk leave ``folder`` as it was, a cache already there included, and no folder
    where there was none."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"data.cache {folder}: not a folder")
    files = sorted(set(paths))
    shapes = _image_shapes(files)
    made = _outermost_missing(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.writing-", dir=folder.parent))
    try:
        total = _write_into(staging, files, shapes, workers)
        folder.mkdir(exist_ok=True)
        (folder / INDEX_FILE).unlink(missing_ok=True)  # never an old index over new pixels
        os.replace(staging / PIXELS_FILE, folder / PIXELS_FILE)
        os.replace(staging / INDEX_FILE, folder / INDEX_FILE)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    staging.rmdir()
    return total


def _outermost_missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist yet (what writing the
    cache creates, and a failure removes), or None when ``folder`` exists."""
    missing = None
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return missing
        missing = candidate
    return missing


def _image_shapes(files: Sequence[str]) -> list[tuple[int, int]]:
    """Each file's (height, width), from its header; a file that does not open, named."""
    image = pillow()
    shapes = []
    for path in files:
        try:
            with image.open(path) as opened:
                shapes.append(opened.size[::-1])
        except UNDECODABLE as error:
            raise InputError(f"cannot decode image {path}: {error}") from None
    return shapes


def _write_into(folder: Path, files: Sequence[str], shapes: Sequence[tuple[int, int]], workers: int) -> int:
    """The pixels file and its index in ``folder``; the bytes of pixels written."""
    sizes = np.asarray([height * width * 3 for height, width in shapes], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    with open(folder / PIXELS_FILE, "wb") as pixels:
        pixels.truncate(total)
    tasks = [
        (str(folder / PIXELS_FILE), files[i : i + _FILES_A_TASK], starts[i : i + _FILES_A_TASK].tolist())
        for i in range(0, len(files), _FILES_A_TASK)
    ]
    # spawned (never forked: the caller may hold a framework's threads), with no more
    # workers than tasks
    with ProcessPoolExecutor(max(1, min(workers, len(tasks))), mp_context=get_context("spawn")) as pool:
        for failure in pool.map(_decode_files, tasks):
            if failure is not None:
                raise InputError(failure)
    entries = [
        {"path": path, "stamp": list(file_stamp(path)), "start": int(start), "shape": [height, width]}
        for path, start, (height, width) in zip(files, starts, shapes, strict=True)
    ]
    (folder / INDEX_FILE).write_text(json.dumps({"images": entries}) + "\n", encoding="utf-8")
    return total


def _decode_files(task: tuple[str, list[str], list[int]]) -> str | None:
    """One task: its files decoded (RGB, full size) into the pixels file at their starts;
    the first file that does not decode, named (None: all did)."""
    pixels_path, paths, starts = task
    image = pillow()
    pixels = np.memmap(pixels_path, np.uint8, mode="r+")
    try:
        for path, start in zip(paths, starts, strict=True):
            try:
                with image.open(path) as opened:
                    decoded = np.asarray(opened.convert("RGB"), np.uint8)
            except UNDECODABLE as error:
                return f"cannot decode image {path}: {error}"
            pixels[start : start + decoded.size] = decoded.reshape(-1)
        pixels.flush()
    finally:
        del pixels
    return None


def cached_rows(folder: str, paths: Sequence[str], field: str, source: str | None) -> CachedRows:
    """Where each of ``paths`` lies in the cache at ``folder``; a missing cache, or one
    without a file or with a changed one: a PlanError naming ``field`` and the command that
    writes it."""
    index_path = Path(folder) / INDEX_FILE
    remedy = "write it with `crosstrain data cache PLAN`"
    if not index_path.is_file() or not (Path(folder) / PIXELS_FILE).is_file():
        raise PlanError(f"{folder} holds no decoded cache: {remedy}", field=field, source=source)
    try:
        images = json.loads(index_path.read_text(encoding="utf-8"))["images"]
        known = {entry["path"]: entry for entry in images}
    except (OSError, ValueError, KeyError, TypeError) as error:
        message = f"{index_path} is not a cache index ({error}): {remedy}"
        raise PlanError(message, field=field, source=source) from None
    entries = np.zeros((len(paths), 3), np.int64)
    for k, path in enumerate(paths):
        entry: dict[str, Any] | None = known.get(path)
        if entry is None or tuple(entry["stamp"]) != file_stamp(path):
            change = "is not in it" if entry is None else "changed since it was written"
            message = f"the cache in {folder} is stale: {path} {change}; {remedy}"
            raise PlanError(message, field=field, source=source)
        entries[k] = (entry["start"], *entry["shape"])
    return CachedRows(folder, entries)
