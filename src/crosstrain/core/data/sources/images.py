"""``data.source = "images"``: image files decoded on the fly by one host pipeline.

Where the images are: a folder of class folders (``root/<class>/*.jpg|jpeg|png``) or a
``.csv``/``.parquet`` index with columns ``path`` (relative to the index's folder) and
``label`` (a class name). Classes are sorted by name; label i is the i-th class.

How a row is read (:class:`ImageRows`): the file is opened (its header gives the size), a
box is chosen (training: the random resized crop of :mod:`crosstrain.core.data.augment`; else
the largest centred box of the output's aspect ratio), a JPEG is decoded at the smallest
of its 1/1, 1/2, 1/4, 1/8 scales that still holds the box at the output size (Pillow's
``draft``: most of a large JPEG's decoding is skipped), the box resized to ``image_size``
(bilinear, antialiased), then padded-cropped, flipped and colour-jittered as drawn (the
jitter on the host too: docs/data.md says why). Rows come out uint8,
channels-last: they stay uint8 until the backend casts and scales them where the model
runs. Every backend reads rows through this one decoder, so torch, tf and jax see the same
pixels.

Rows of a batch are decoded by a pool of worker processes writing into shared memory
(:mod:`crosstrain.core.data.sources.pool`: Pillow holds the GIL for much of the work, so
threads do not scale), each training process decoding only the rows of its own shard.
"""

from __future__ import annotations

import collections
import csv
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from crosstrain.core.data.arrays import StoredRows, Translated, Translation
from crosstrain.core.data.augment import Augmentation, Mixing, mix_rows, mixed_targets, mixing, uniforms
from crosstrain.core.data.sources.cache import CachedRows
from crosstrain.core.data.sources.decoding import IMAGES_EXTRA, UNDECODABLE, FileRows, decode_image, pillow
from crosstrain.core.data.sources.pool import WORKERS_VARIABLES, DecodePool, Reading
from crosstrain.core.errors import InputError, PlanError

__all__ = ["IMAGES_EXTRA", "ImageIndex", "ImageRows", "batches", "decode_image", "pillow"]

#: the files a class folder's images are (case-insensitive)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
#: what Pillow must find in a file's header
IMAGE_FORMATS = ("JPEG", "PNG")
INDEX_COLUMNS = ("path", "label")
PARQUET_EXTRA = "pip install 'crosstrain[table]'"
#: a run folder's file naming the classes, label i the i-th
CLASSES_FILE = "classes.json"


@attrs.frozen(eq=False)
class ImageIndex:
    """Image files, each one's label, and the class names the labels index."""

    paths: tuple[str, ...]
    labels: np.ndarray
    classes: tuple[str, ...]


# --------------------------------------------------------------------------- finding the files


def read_image_index(path: str, field: str, source: str | None) -> ImageIndex:
    """The images ``path`` names: a folder of class folders, or a .csv/.parquet index."""
    where = Path(path)
    if where.is_dir():
        return scan_class_folders(where, field, source)
    if where.suffix.lower() in (".csv", ".parquet"):
        if not where.is_file():
            raise PlanError(f"no such file {path}", field=field, source=source)
        return _read_index_file(where, field, source)
    if where.exists():
        raise PlanError(
            f"{path} is neither a folder of class folders nor a .csv/.parquet index",
            field=field,
            source=source,
        )
    raise PlanError(f"no such folder {path}", field=field, source=source)


def scan_class_folders(root: Path, field: str, source: str | None) -> ImageIndex:
    """``root/<class>/*.jpg|jpeg|png``, classes and files sorted by name."""
    classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    if not classes:
        raise PlanError(f"{root} holds no class folders (root/<class>/*.jpg)", field=field, source=source)
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = sorted(str(file) for file in (root / name).iterdir() if file.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise PlanError(
                f"class folder {root / name} holds no images ({', '.join(IMAGE_SUFFIXES)})",
                field=field,
                source=source,
            )
        paths.extend(found)
        labels.extend([label] * len(found))
    return ImageIndex(tuple(paths), np.asarray(labels, np.int64), tuple(classes))


def _read_index_file(path: Path, field: str, source: str | None) -> ImageIndex:
    """An index's rows: each file (relative to the index's folder) and its class name."""
    columns = (
        _read_parquet(path, field, source)
        if path.suffix.lower() == ".parquet"
        else _read_csv(path, field, source)
    )
    files, names = columns
    if not files:
        raise PlanError(f"{path} lists no images", field=field, source=source)
    classes = tuple(sorted(set(names)))
    label_of = {name: label for label, name in enumerate(classes)}
    paths = tuple(str(path.parent / file) for file in files)
    return ImageIndex(paths, np.asarray([label_of[name] for name in names], np.int64), classes)


def _read_csv(path: Path, field: str, source: str | None) -> tuple[list[str], list[str]]:
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            _check_columns(reader.fieldnames or [], path, field, source)
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise PlanError(f"cannot read {path}: {error}", field=field, source=source) from None
    return [row["path"] for row in rows], [row["label"] for row in rows]


def _read_parquet(path: Path, field: str, source: str | None) -> tuple[list[str], list[str]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise InputError(f"{path}: a .parquet index needs pyarrow: {PARQUET_EXTRA}") from None
    try:
        table = parquet.read_table(path)
    except (OSError, ValueError) as error:
        raise PlanError(f"cannot read {path}: {error}", field=field, source=source) from None
    _check_columns(table.column_names, path, field, source)
    return (
        [str(value) for value in table.column("path").to_pylist()],
        [str(value) for value in table.column("label").to_pylist()],
    )


def _check_columns(found: Sequence[str], path: Path, field: str, source: str | None) -> None:
    for column in INDEX_COLUMNS:
        if column not in found:
            raise PlanError(
                f"{path} has no column {column!r} (it has {', '.join(found) or 'none'}; an index "
                f"needs columns {', '.join(INDEX_COLUMNS)})",
                field=field,
                source=source,
            )


#: how each format's file ends when it is whole: JPEG's end-of-image marker, PNG's IEND chunk
_FORMAT_ENDS = {"JPEG": b"\xff\xd9", "PNG": b"IEND\xaeB`\x82"}
#: the bytes at a file's end searched for its format's end (a JPEG may carry padding after it)
_TAIL_BYTES = 64


def check_image_headers(paths: Iterable[str], field: str, source: str | None) -> None:
    """Every file opens as a JPEG or PNG and is not cut short: Pillow reads its header, and
    its last bytes must hold its format's end, in a pool of threads; a file without that
    end is decoded, and refused if it does not decode (Pillow fails on a file cut short);
    the first that fails is named. Damage inside a whole file (a PNG's broken data stream)
    is met, and named with its rank, when a step decodes it."""
    image = pillow()

    def problem(path: str) -> str | None:
        try:
            with image.open(path) as opened:
                if opened.format not in IMAGE_FORMATS:
                    return f"{path} is a {opened.format} image; images are read as {', '.join(IMAGE_FORMATS)}"
                if not _ends_whole(path, _FORMAT_ENDS[opened.format]):
                    opened.load()  # padding or a writer's extra bytes decode; a cut file raises
        except UNDECODABLE as error:
            return f"cannot read image {path}: {error}"
        return None

    with ThreadPoolExecutor(decode_workers(), thread_name_prefix="crosstrain-headers") as threads:
        for found in threads.map(problem, paths):
            if found is not None:
                raise PlanError(found, field=field, source=source)


def _ends_whole(path: str, end: bytes) -> bool:
    with open(path, "rb") as file:
        file.seek(max(0, file.seek(0, os.SEEK_END) - _TAIL_BYTES))
        return end in file.read()


def check_classes(train: Sequence[str], evaluation: Sequence[str], field: str, source: str | None) -> None:
    """An eval set's classes are among the training set's (its labels index those)."""
    unknown = sorted(set(evaluation) - set(train))
    if unknown:
        raise PlanError(
            f"class {unknown[0]!r} of the eval images is not one the training images have "
            f"({', '.join(train)})",
            field=field,
            source=source,
        )


# --------------------------------------------------------------------------- decoding


class TranslatesImageRows(Protocol[Translation]):
    """The method image rows call on a translator (the whole translator:
    :class:`crosstrain.core.data.rows.RowsTranslator`)."""

    def images(self, rows: ImageRows) -> Translation: ...


class TranslatesMixedTargets(Protocol[Translation]):
    """The method a mixing set's labels call on a translator: they are read on the host."""

    def host(self, rows: MixedTargets) -> Translation: ...


#: the training processes on this machine, which share its cores (:func:`share_cores`)
_PROCESSES_HERE = 1
_POOL: DecodePool | None = None


def share_cores(processes: int) -> None:
    """This machine's cores are shared by ``processes`` training processes: each decodes
    with its share (set before the first decode; the loop sets it from the world)."""
    global _PROCESSES_HERE
    _PROCESSES_HERE = max(1, processes)


def decode_workers() -> int:
    """The decoding pool's worker processes: ``CROSSTRAIN_DECODE_WORKERS`` (or its old name
    ``CROSSTRAIN_DECODE_THREADS``), else this process's share of the cores it may run on."""
    for variable in WORKERS_VARIABLES:
        stated = os.environ.get(variable)
        if stated:
            try:
                return max(1, int(stated))
            except ValueError:
                raise InputError(f"{variable}={stated!r}: must be a whole number of workers") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // _PROCESSES_HERE)


def decode_pool() -> DecodePool:
    """This process's decoding workers, started on first use; after one died, started
    afresh once a read has raised the death (a death between batches is not passed over)."""
    global _POOL
    if _POOL is None or (_POOL.broken is not None and _POOL.reported):
        _POOL = DecodePool(decode_workers())
    return _POOL


def _forget_the_parents_pool() -> None:
    """A forked child (a torch worker forked from its launcher) starts its own pool: the
    parent's workers, pipes and buffers stay the parent's to use and free."""
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_parents_pool)


def close_decode_pool() -> None:
    """Stop this process's decoding workers and free their shared memory, if it started
    them. A worker process calls it as it ends: a process that ends without running its exit
    handlers (a torch worker forked by the elastic agent) would otherwise leave the buffers
    to multiprocessing's resource tracker, which warns of them on the launcher's stderr."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


class ImageRows:
    """Rows of image files, read as float32 channels-last ``(h, w, 3)`` rows (stored
    uint8: :meth:`read` gives them so). Rows read with an epoch are augmented as drawn for
    that epoch (``augmentation``); rows read without one get the evaluation's centre box.
    ``cached``: where the files' decoded pixels lie in a decoded cache (``data.cache``);
    ``antialias``: resized by Pillow's antialiased filter, else OpenCV's exact bilinear one
    (``data.antialias``)."""

    def __init__(
        self,
        paths: np.ndarray,
        image_size: tuple[int, int],
        augmentation: Augmentation | None = None,
        seed: int = 0,
        cached: CachedRows | None = None,
        antialias: bool = True,
    ) -> None:
        self.paths = paths
        self.image_size = image_size
        self.augmentation = augmentation
        self.seed = seed
        self.cached = cached
        self.antialias = antialias

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.paths), *self.image_size, 3)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(np.float32)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, indices: Any) -> np.ndarray:
        rows = np.atleast_1d(np.asarray(indices, np.int64))
        read = self.read(rows).astype(np.float32)
        return read if np.ndim(indices) else read[0]

    def take(self, indices: np.ndarray) -> ImageRows:
        """Some rows, not decoded."""
        cached = None if self.cached is None else self.cached.take(indices)
        return ImageRows(
            self.paths[indices], self.image_size, self.augmentation, self.seed, cached, self.antialias
        )

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        """Rows ``indices`` as the model takes them (float32), read in ``epoch``."""
        return self.read(indices, epoch).astype(self.dtype)

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows:
        """The rows decoded (uint8, in ``epoch``), the array their batch."""
        decoded = self.read(indices, epoch)
        return decoded, np.arange(len(indices)), decoded.shape

    def translate(self, translator: TranslatesImageRows[Translated]) -> Translated:
        return translator.images(self)

    def augmented(self, augmentation: Augmentation | None, seed: int) -> ImageRows:
        """These rows, read with ``augmentation`` when read with an epoch."""
        return ImageRows(self.paths, self.image_size, augmentation, seed, self.cached, self.antialias)

    def read(
        self, indices: np.ndarray, epoch: int | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """uint8 [len(indices), h, w, 3]: rows ``indices`` decoded by the pool's workers
        (copied into ``out`` when given: a backend's pinned buffer); augmented as drawn for
        ``epoch`` when given (and this is a training set)."""
        return self.start_read(indices, epoch, out).result()

    def start_read(
        self, indices: np.ndarray, epoch: int | None = None, out: np.ndarray | None = None
    ) -> ImageReading:
        """Start decoding rows ``indices``: :meth:`read` without waiting (several batches
        can be in flight: :func:`batches`). With mixup or cutmix, each row's partner is
        decoded in the same batch (its own draws), and the pair mixed once both are in."""
        indices = np.asarray(indices, np.int64)
        augmentation = self.augmentation
        if epoch is not None and augmentation is not None and augmentation.mixes:
            plan = mixing(augmentation, self.seed, epoch, indices, len(self), self.image_size)
            both = self._start_decoding(np.concatenate([indices, plan.partners]), epoch, None)
            return MixedReading(both, plan, out)
        return self._start_decoding(indices, epoch, out)

    def _start_decoding(self, indices: np.ndarray, epoch: int | None, out: np.ndarray | None) -> Reading:
        if out is None:
            out = np.empty((len(indices), *self.image_size, 3), np.uint8)
        augmentation = self.augmentation if epoch is not None else None
        draws = None
        if augmentation is not None and augmentation.transforms_images:
            assert epoch is not None
            draws = uniforms(self.seed, epoch, indices)
        paths = [str(path) for path in self.paths[indices]]
        cached = None if self.cached is None else (self.cached.folder, self.cached.entries[indices])
        rows = FileRows(paths, self.image_size, augmentation, draws, cached, self.antialias)
        return decode_pool().submit(rows, out)


@attrs.frozen(eq=False)
class MixedReading:
    """A batch decoded with its partners (the rows after the batch's own), mixed once read."""

    both: Reading
    plan: Mixing
    out: np.ndarray | None

    def result(self) -> np.ndarray:
        decoded = self.both.result()
        count = len(self.plan.lam)
        mixed = mix_rows(decoded[:count], decoded[count:], self.plan)
        if self.out is None:
            return mixed
        self.out[...] = mixed
        return self.out

    def discard(self) -> None:
        self.both.discard()


#: image rows decoding (:meth:`ImageRows.start_read`): ``result()`` waits for them
ImageReading = Reading | MixedReading


class MixedTargets:
    """A mixing training set's labels: read in an epoch, each row's (label, partner's label,
    lam) as float32 [rows, 3], the pairs and weights its images are mixed with; read
    without one (or indexed), the labels."""

    def __init__(self, labels: np.ndarray, images: ImageRows) -> None:
        assert images.augmentation is not None and images.augmentation.mixes
        self.labels, self.images = labels, images

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.labels.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.labels.dtype

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, indices: Any) -> np.ndarray:
        return np.asarray(self.labels[indices])

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Some rows' labels, unmixed (as read without an epoch)."""
        return self[indices]

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        if epoch is None:
            return np.asarray(self.labels[indices])
        augmentation, images = self.images.augmentation, self.images
        assert augmentation is not None
        plan = mixing(augmentation, images.seed, epoch, indices, len(images), images.image_size)
        return mixed_targets(self.labels[indices], self.labels[plan.partners], plan)

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows | None:
        """None: mixed labels are more than a gather of rows."""
        return None

    def translate(self, translator: TranslatesMixedTargets[Translated]) -> Translated:
        return translator.host(self)


def batches(
    rows: ImageRows, index_batches: Iterable[np.ndarray], epoch: int | None, ahead: int = 2
) -> Iterator[np.ndarray]:
    """uint8 batches of ``rows`` for each index array in turn, ``ahead`` batches decoding
    in the workers before they are asked for (what a benchmark, or a loop of its own, drives)."""
    pending: collections.deque[ImageReading] = collections.deque()
    try:
        for indices in index_batches:
            pending.append(rows.start_read(indices, epoch))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for reading in pending:  # left early: let the workers finish, free their buffers
            reading.discard()
