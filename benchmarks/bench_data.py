"""The image pipeline against torch's DataLoader: decode + random resized crop + flip of an
ImageNet-like folder, in images/s on all cores of the machine.

    python benchmarks/bench_data.py [--images 4096] [--batch 256] [--workers N] [--out DIR]

The benchmark makes its own folder once (``--out``, default a temporary folder): synthetic
photographs of 500x375 pixels, JPEG quality 90 (about 43 KB each, the size of an ImageNet
validation image), in 10 class folders. Then, on the same files and the same cores:

- crosstrain: the ``source = "images"`` pipeline with ``[data.augment] crop_scale =
  [0.08, 1.0]`` and ``flip = true`` (torchvision's RandomResizedCrop defaults), batches of
  ``--batch`` uint8 rows of 224x224x3, decoded by its pool of worker processes; twice:
  resized by Pillow's antialiased bilinear filter (``data.antialias = true``, the default)
  and by OpenCV's exact bilinear one (``data.antialias = false``);
- with ``--cache``, the same reading a decoded cache (``data.cache``, written first as
  ``crosstrain data cache`` writes it: every image decoded once), resized by OpenCV;
- torch's DataLoader with ``--workers`` worker processes, each decoding with torchvision's
  ``decode_jpeg`` and transforming with ``v2.RandomResizedCrop(224)`` and
  ``v2.RandomHorizontalFlip()``, collated into uint8 batches. Where torchvision cannot be
  imported (no wheel matches a CPU-only torch on some machines), the workers decode with
  Pillow and crop with ``Image.resize(box=...)``, what torchvision's ImageFolder does by
  default; the output says which.

Each side reads every image once as warm-up (the page cache then holds the files for
both), then is timed over two passes.

``--train`` (a GPU) then trains the zoo's ResNet-50 (examples/zoo/resnet50.toml, bf16,
``train.compile``, batch ``--batch``) with ``crosstrain run`` for ``--epochs``: from the
folder (decoded, cropped and flipped each step as above; resized by OpenCV, and with
``--pillow`` by Pillow too) and from the same images decoded once into a uint8 ``.npy`` kept
on the GPU (``placement = "device"``), and with ``--cache`` from the decoded cache as well
(``data.cache``); images/s over epochs 2..N of each, and their ratio: 1.0 means the GPU never
waits on decoding. ``--train-only`` skips the readers' comparison (device time is dear).

Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

SIDE = 224
CLASSES = 10


def photograph(rng: np.random.Generator, width: int = 500, height: int = 375) -> bytes:
    """A JPEG (quality 90) that compresses like a photograph: a smooth colour field with a
    fine texture over it (pure noise would be three times larger, a flat field ten times
    smaller than a real photo)."""
    coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    grain = rng.normal(128.0, 40.0, size=(height // 2, width // 2, 3)).clip(0, 255).astype(np.uint8)
    texture = np.asarray(
        Image.fromarray(grain).resize((width, height), Image.Resampling.BILINEAR), np.float32
    )
    pixels = np.clip(field + (texture - 128.0) * 0.3, 0, 255).astype(np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, "JPEG", quality=90)
    return encoded.getvalue()


def make_folder(root: Path, images: int, seed: int = 0) -> list[Path]:
    """``root/class_K/NNNNNN.jpg``, written once by every core (an existing folder of that
    size is reused); image i is the same whoever writes it (its own seeded generator)."""
    paths = [root / f"class_{i % CLASSES}" / f"{i:06d}.jpg" for i in range(images)]
    missing = [(path, seed, i) for i, path in enumerate(paths) if not path.is_file()]
    for folder in {path.parent for path, _, _ in missing}:
        folder.mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("fork").Pool() as pool:
        pool.map(_write_photograph, missing, chunksize=64)
    return paths


def _write_photograph(job: tuple[Path, int, int]) -> None:
    path, seed, index = job
    path.write_bytes(photograph(np.random.default_rng([seed, index])))


# --------------------------------------------------------------------------- DataLoader


class JpegFolder:
    """A map-style torch Dataset over the files: decode, random resized crop, flip."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.labels = [int(path.parent.name.split("_")[1]) for path in paths]
        self.transform: Callable[[Any], Any] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self.transform is None:  # built in the worker process, after the fork
            self.transform = torchvision_transform() or pillow_transform()
        return self.transform(self.paths[index]), self.labels[index]


def torchvision_transform() -> Callable[[Path], Any] | None:
    """torchvision's decode_jpeg + v2 RandomResizedCrop(224) + RandomHorizontalFlip, or None."""
    try:
        from torchvision.io import decode_jpeg, read_file
        from torchvision.transforms import v2
    except Exception:  # a torchvision whose C++ ops do not match this torch
        return None
    augment = v2.Compose([v2.RandomResizedCrop(SIDE, antialias=True), v2.RandomHorizontalFlip()])
    return lambda path: augment(decode_jpeg(read_file(str(path))))


def pillow_transform() -> Callable[[Path], Any]:
    """Pillow decode + torchvision's RandomResizedCrop box rule + flip, as CHW uint8."""
    import torch

    rng = np.random.default_rng()

    def transform(path: Path) -> Any:
        with Image.open(path) as image:
            image = image.convert("RGB")
            left, top, width, height = crop_box(rng, *image.size)
            out = image.resize(
                (SIDE, SIDE), Image.Resampling.BILINEAR, box=(left, top, left + width, top + height)
            )
        pixels = np.asarray(out)
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))

    return transform


def crop_box(rng: np.random.Generator, width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (scale 0.08..1, ratio 3/4..4/3)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, side, side


def dataloader_batches(paths: list[Path], batch: int, workers: int) -> tuple[str, Iterable[Any]]:
    import torch.utils.data

    name = "torchvision decode_jpeg + v2" if torchvision_transform() is not None else "Pillow"
    loader = torch.utils.data.DataLoader(
        JpegFolder(paths),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        prefetch_factor=4,
        drop_last=True,
    )
    return f"torch DataLoader ({workers} workers, {name})", loader


# --------------------------------------------------------------------------- crosstrain


def crosstrain_batches(
    paths: list[Path], batch: int, workers: int, antialias: bool, cache: Path | None = None
) -> tuple[str, Callable[[], Iterable[Any]]]:
    """The images source's own reader (:class:`ImageRows`, the rows a training step reads),
    with torchvision's crop defaults and a flip, one pool of ``workers`` decoding processes,
    resized by Pillow (``antialias``) or OpenCV; reading a decoded cache at ``cache`` (written
    there first, as ``crosstrain data cache`` writes it) when given."""
    os.environ["CROSSTRAIN_DECODE_WORKERS"] = str(workers)
    from crosstrain.core.data.augment import Augmentation
    from crosstrain.core.data.sources.cache import cached_rows, write_cache
    from crosstrain.core.data.sources.images import ImageRows, batches

    files = [str(path) for path in paths]
    cached = None
    if cache is not None:
        started = time.perf_counter()
        written = write_cache(cache, files, workers)
        print(f"decoded cache: {written / 1e9:.1f} GB in {time.perf_counter() - started:.0f} s")
        cached = cached_rows(str(cache), files, "data.cache", None)
    augmentation = Augmentation(crop_scale=(0.08, 1.0), flip=True)
    rows = ImageRows(
        np.asarray(files), (SIDE, SIDE), augmentation, seed=0, cached=cached, antialias=antialias
    )
    epochs = iter(range(1_000_000))

    def one_epoch() -> Iterable[Any]:
        epoch = next(epochs)
        order = np.random.default_rng([0, epoch]).permutation(len(paths))
        index_batches = [order[i : i + batch] for i in range(0, len(order) - batch + 1, batch)]
        return ((images,) for images in batches(rows, index_batches, epoch))

    read = "the decoded cache" if cache is not None else "files"
    resize = "Pillow" if antialias else "OpenCV"
    return f"crosstrain images source ({workers} workers, {read}, {resize})", one_epoch


# --------------------------------------------------------------------------- training

ZOO_RESNET = Path(__file__).resolve().parents[1] / "examples" / "zoo" / "resnet50.toml"


def resnet_plan(directory: Path, name: str, data: str, epochs: int, batch: int) -> Path:
    """The zoo's ResNet-50 reading ``data`` (a [data] table's lines), bf16 and compiled."""
    text = ZOO_RESNET.read_text()
    start, end = text.index("[data]\n"), text.index("\n[loss]")
    text = text[:start] + "[data]\n" + data + "\n" + text[end:]
    path = directory / f"{name}.toml"
    overrides = (
        f'\n[train]\nglobal_batch_size = {batch}\nepochs = {epochs}\nprecision = "bf16"\ncompile = true\n'
    )
    path.write_text(text[: text.index("[train]")] + overrides.lstrip("\n"))
    return path


SCALING = "scale = 0.00392156862745098\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]\n"


def train_resnet(root: Path, paths: list[Path], epochs: int, batch: int, cached: bool, pillow: bool) -> None:
    """ResNet-50 from the JPEG folder (resized by OpenCV, and by Pillow too with ``pillow``;
    and from its decoded cache, ``cached``) against ResNet-50 from the same images on the GPU."""
    from bench_e2e import run_crosstrain  # the end-to-end benchmark's reader of epoch lines

    from crosstrain.core.data.sources.images import ImageRows

    decoded = ImageRows(np.asarray([str(path) for path in paths]), (SIDE, SIDE)).read(np.arange(len(paths)))
    np.save(root / "x.npy", decoded)
    np.save(root / "y.npy", np.asarray([int(path.parent.name.split("_")[1]) for path in paths]))
    folder = (
        f'source = "images"\npath = "{root / "photos"}"\nimage_size = [{SIDE}, {SIDE}]\neval_fraction = 0\n'
        + SCALING
        + "antialias = false\n[data.augment]\ncrop_scale = [0.08, 1.0]\nflip = true\n"
    )
    resident = (
        f'source = "npy"\nx_path = "{root / "x.npy"}"\ny_path = "{root / "y.npy"}"\neval_fraction = 0\n'
        f'placement = "device"\n{SCALING}'
    )
    sides = [("from the JPEG folder", folder), ("from uint8 rows on the GPU", resident)]
    if cached:  # the cache crosstrain_batches wrote
        cache_line = f'cache = "{root / "photos.cache"}"\n[data.augment]'
        sides.append(("from the decoded cache", folder.replace("[data.augment]", cache_line)))
    if pillow:
        sides.append(("from the JPEG folder, Pillow", folder.replace("antialias = false\n", "")))
    rates = {}
    for name, data in sides:
        plan = resnet_plan(root, name.split()[-1].lower().strip(","), data, epochs, batch)
        epoch_rates, _ = run_crosstrain(plan, root / f"run-{plan.stem}", "cuda", "torch")
        rates[name] = sum(epoch_rates) / len(epoch_rates)
        print(f"ResNet-50 bf16 compiled, {name:30s} {rates[name]:10,.0f} images/s")
    for name in rates:
        if name != "from uint8 rows on the GPU":
            print(f"{name} / GPU-resident: {rates[name] / rates['from uint8 rows on the GPU']:.2f}")


# --------------------------------------------------------------------------- timing


def images_per_second(batches: Callable[[], Iterable[Any]], passes: int) -> float:
    """Images/s over ``passes`` passes after one warm-up pass."""
    for _ in batches():
        pass
    started, images = time.perf_counter(), 0
    for _ in range(passes):
        for images_batch in batches():
            images += len(images_batch[0])
    return images / (time.perf_counter() - started)


def compare_readers(root: Path, paths: list[Path], args: argparse.Namespace) -> None:
    """torch's DataLoader, then crosstrain's reader resized by Pillow, by OpenCV, and (with
    ``--cache``) from the decoded cache: images/s of each, and its ratio to the DataLoader."""
    label, loader = dataloader_batches(paths, args.batch, args.workers)
    native = images_per_second(lambda: loader, args.passes)
    print(f"{label:60s} {native:10,.0f} images/s")
    readers = [(True, None), (False, None)] + [(False, root / "photos.cache")] * args.cache
    for antialias, cache in readers:
        label, ours = crosstrain_batches(paths, args.batch, args.workers, antialias, cache)
        rate = images_per_second(ours, args.passes)
        print(f"{label:60s} {rate:10,.0f} images/s   {rate / native:.2f}x the DataLoader")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cache", action="store_true", help="also read the images from a decoded cache")
    parser.add_argument("--train", action="store_true", help="also train ResNet-50 from the folder (a GPU)")
    parser.add_argument("--pillow", action="store_true", help="train from the folder resized by Pillow too")
    parser.add_argument(
        "--train-only", action="store_true", help="with --train: skip the readers' comparison"
    )
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-data-"))
    started = time.perf_counter()
    paths = make_folder(root / "photos", args.images)
    size = sum(path.stat().st_size for path in paths) / len(paths)
    print(
        f"{len(paths)} JPEGs of 500x375, {size / 1e3:.1f} KB on average, in {root / 'photos'}"
        f" ({time.perf_counter() - started:.0f} s); {args.workers} workers, batch {args.batch}"
    )
    if args.train_only:
        if args.cache:
            from crosstrain.core.data.sources.cache import write_cache

            write_cache(root / "photos.cache", [str(path) for path in paths], args.workers)
    else:
        compare_readers(root, paths, args)
    if args.train:
        train_resnet(root, paths, args.epochs, args.batch, args.cache, args.pillow)


if __name__ == "__main__":
    main()
