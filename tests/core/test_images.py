"""The images source without a framework: the augmentation's draws against a plain
reference, the folder and index loaders, and each bad input's one line."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import attrs
import numpy as np
import pytest
from PIL import Image

from crosstrain.core.admission import check_image_files
from crosstrain.core.augment import (
    Augmentation,
    color_jitter,
    crop_boxes,
    flips,
    jitter_factors,
    mix_rows,
    mixed_targets,
    mixing,
    pad_offsets,
    uniforms,
)
from crosstrain.core.convert import structure_plan
from crosstrain.core.data import load_datasets, read_rows
from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.plan import Plan
from crosstrain.core.sources import images
from crosstrain.core.sources.images import (
    ImageRows,
    batches,
    check_image_headers,
    decode_image,
    read_image_index,
)

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
    misfit = r"model\.input_shape: \[64\], but images of data\.image_size \[8, 8\] are rows \[8, 8, 3\]"
    with pytest.raises(PlanError, match=misfit):
        load_datasets(_plan(tmp_path, 'path = "photos"', input_shape="[64]"))


@pytest.mark.parametrize(
    ("data", "found"),
    [
        ('image_size = [8, 8]\nplacement = "device"', "data: data.placement 'device'"),
        ('source = "digits"\n[data.augment]\nflip = true', "data.augment transforms images"),
        ("[data.augment]\ncrop_scale = [0.5, 0.2]", "data.augment.crop_scale: must be [lo, hi]"),
        ("[data.augment]\ncolor_jitter = [0.4, -1, 0]", "data.augment.color_jitter: must be"),
        ("", "source 'images' needs data.image_size"),
    ],
)
def test_a_plan_s_image_fields_are_checked_as_it_loads(data: str, found: str) -> None:
    source = "" if "source" in data else 'source = "images"\npath = "p"\n'
    text = f'[model]\ninput_shape = [8, 8, 3]\nlayers = [{{ type = "flatten" }}]\n[data]\n{source}{data}'
    with pytest.raises(PlanError) as raised:
        structure_plan(tomllib.loads(text), source="plan.toml")
    assert found in str(raised.value)


def test_a_parquet_index_needs_pyarrow_named_by_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "index.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(InputError, match=r"needs pyarrow: pip install 'crosstrain\[table\]'"):
        read_image_index(str(tmp_path / "index.parquet"), "data.path", None)


def test_a_parquet_index_lists_the_images(tmp_path: Path) -> None:
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    root = _folder(tmp_path / "photos")
    index = read_image_index(str(root), "data.path", None)
    table = pyarrow.table(
        {
            "path": [str(Path(p).relative_to(tmp_path)) for p in index.paths],
            "label": [Path(p).parent.name for p in index.paths],
        }
    )
    parquet.write_table(table, tmp_path / "index.parquet")
    listed = read_image_index(str(tmp_path / "index.parquet"), "data.path", None)
    assert listed.paths == index.paths and np.array_equal(listed.labels, index.labels)


def test_batches_read_ahead_give_what_each_read_gives(tmp_path: Path) -> None:
    _folder(tmp_path / "photos")
    plan = _plan(tmp_path, 'path = "photos"\neval_fraction = 0.0\n[data.augment]\ncrop_scale = [0.3, 1.0]')
    rows = load_datasets(plan).train.x
    assert isinstance(rows, ImageRows)
    order = [np.array([4, 0, 8]), np.array([1, 2]), np.array([7, 3, 5, 6])]
    for got, indices in zip(batches(rows, order, epoch=2, ahead=1), order, strict=True):
        assert np.array_equal(got, rows.read(indices, 2))


def test_no_pillow_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if not installed
    with pytest.raises(InputError, match=r"needs Pillow: pip install 'crosstrain\[images\]'"):
        check_image_headers([str(tmp_path / "a.jpg")], "data.path", None)


# --------------------------------------------------------------------------- the decoding workers


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch):
    """A fresh pool of two decoding worker processes (closed after the test)."""
    monkeypatch.setenv("CROSSTRAIN_DECODE_WORKERS", "2")
    monkeypatch.setattr(images, "_POOL", None)
    yield
    if images._POOL is not None:
        images._POOL.close()


def _photographs(root: Path, count: int) -> np.ndarray:
    """JPEGs of a few sizes (wider and taller than the output), with detail a resize shows."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        height, width = (45 + 7 * (k % 4), 60 - 5 * (k % 3))
        smooth = np.cumsum(rng.integers(-9, 10, (height, width, 3)), axis=1) % 256
        paths.append(root / f"{k}.jpg")
        Image.fromarray(smooth.astype(np.uint8)).save(paths[-1], quality=90)
    return np.asarray([str(path) for path in paths])


@pytest.mark.timeout(120)
def test_the_worker_processes_give_the_rows_decode_image_gives_bit_for_bit(
    tmp_path: Path, two_workers
) -> None:
    """An augmented batch (crop, flip, padded crop, jitter) cut between two workers equals
    ``decode_image`` called row by row here, read into a caller's buffer or not, and read
    ahead several batches at a time."""
    augmentation = Augmentation(flip=True, crop_scale=(0.2, 1.0), pad_crop=2, color_jitter=(0.4, 0.4, 0.4))
    rows = ImageRows(_photographs(tmp_path, 13), (16, 24), augmentation, seed=5)
    indices = np.array([12, 3, 7, 0, 9, 1, 11, 4, 2])
    draws = uniforms(5, 3, indices)
    expected = np.stack(
        [decode_image(rows.paths[row], (16, 24), augmentation, draws[k]) for k, row in enumerate(indices)]
    )
    assert np.array_equal(rows.read(indices, 3), expected)
    buffer = np.zeros_like(expected)
    assert rows.read(indices, 3, out=buffer) is buffer and np.array_equal(buffer, expected)
    plain = np.stack([decode_image(rows.paths[row], (16, 24), None, None) for row in indices])
    assert np.array_equal(rows.read(indices), plain)  # no epoch: the centre box
    order = [indices[:4], indices[4:], indices[::-1], indices[:1]]
    for got, batch in zip(batches(rows, order, epoch=3, ahead=3), order, strict=True):
        assert np.array_equal(got, expected[[list(indices).index(row) for row in batch]])
    assert images.decode_pool().workers[0].process.poll() is None  # one pool, still running


def test_a_decoding_worker_imports_no_framework() -> None:
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, crosstrain.core.sources.decoding; "
         "print(sorted({'torch', 'tensorflow', 'jax', 'keras'} & set(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert imported.stdout.strip() == "[]"


@pytest.mark.timeout(120)
def test_a_damaged_file_mid_batch_is_one_line_naming_it(tmp_path: Path, two_workers) -> None:
    """Header sound, pixels cut short: the batch fails with the file named; the workers go on."""
    paths = _photographs(tmp_path, 6)
    data = Path(paths[3]).read_bytes()
    Path(paths[3]).write_bytes(data[: data.index(b"\xff\xda") + 20])
    rows = ImageRows(paths, (8, 8), Augmentation(flip=True), seed=1)
    with pytest.raises(InputError) as raised:
        rows.read(np.arange(6), 0)
    assert str(raised.value).startswith(f"cannot decode image {paths[3]}: ")
    assert "\n" not in str(raised.value)
    assert rows.read(np.array([0, 1, 4, 5]), 0).shape == (4, 8, 8, 3)  # the same pool goes on


@pytest.mark.timeout(120)
def test_a_killed_worker_is_one_line_naming_it_and_the_next_read_starts_afresh(
    tmp_path: Path, two_workers
) -> None:
    rows = ImageRows(_photographs(tmp_path, 6), (8, 8))
    first = rows.read(np.arange(6))
    pool = images.decode_pool()
    victim = pool.workers[1].process
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    with pytest.raises(InputError) as raised:
        rows.read(np.arange(6))
    line = str(raised.value)
    assert line.startswith(f"image decoding worker 1 (pid {victim.pid}) died (killed by signal 9)"), line
    assert "\n" not in line
    for worker in pool.workers:  # the others stop too
        worker.process.wait(timeout=30)
    assert np.array_equal(rows.read(np.arange(6)), first) and images.decode_pool() is not pool


def test_a_shared_memory_folder_too_small_for_a_batch_is_named_before_any_worker_writes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A container's small /dev/shm would kill a worker with SIGBUS mid-batch: refused first."""
    from crosstrain.core.sources import decoding

    class Free:
        f_bavail, f_frsize = 1000, 4096  # 4 MB free

    monkeypatch.setattr(decoding, "_SHM_FOLDER", str(tmp_path))
    monkeypatch.setattr(decoding.os, "statvfs", lambda folder: Free())
    needed = r"has 4096000 bytes free; image decoding needs 38535168 .*--shm-size"
    with pytest.raises(InputError, match=needed):
        decoding._shared_memory(256 * 224 * 224 * 3)


# --------------------------------------------------------------------------- the decoded cache


def _cache_plan(tmp_path: Path) -> Plan:
    return _plan(
        tmp_path,
        'path = "photos"\neval_path = "held_out"\ncache = "photos.cache"\n'
        "[data.augment]\nflip = true\ncrop_scale = [0.3, 1.0]\npad_crop = 1\ncolor_jitter = [0.4, 0.4, 0.4]",
    )


def _write_cache(tmp_path: Path) -> int:
    from crosstrain.cli import main

    return main(["data", "cache", str(tmp_path / "plan.toml")])


@pytest.mark.timeout(120)
def test_rows_read_from_the_decoded_cache_are_the_rows_decoded_from_the_files(
    tmp_path: Path, two_workers, capsys: pytest.CaptureFixture[str]
) -> None:
    """``crosstrain data cache PLAN`` decodes every training and held-out file once; a run of
    the plan then reads them from it: augmented and centre-boxed rows bit for bit those the
    files give (these 12x10 images never decode at a reduced JPEG scale)."""
    _folder(tmp_path / "photos")
    _folder(tmp_path / "held_out")
    (tmp_path / "plan.toml").write_text(
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        '[data]\nsource = "images"\nimage_size = [8, 8]\npath = "photos"\neval_path = "held_out"\n'
        'cache = "photos.cache"\n'
    )
    assert _write_cache(tmp_path) == 0
    assert "18 images decoded" in capsys.readouterr().out
    cached_plan = _cache_plan(tmp_path)
    cached = load_datasets(cached_plan)
    files = load_datasets(attrs.evolve(cached_plan, data=attrs.evolve(cached_plan.data, cache=None)))
    assert isinstance(cached.train.x, ImageRows) and cached.train.x.cached is not None
    rows = np.arange(len(files.train))
    for epoch in (0, 1, None):
        expected = read_rows(files.train.x, rows, epoch)
        assert np.array_equal(read_rows(cached.train.x, rows, epoch), expected)
    assert cached.eval is not None and files.eval is not None
    held_out = np.arange(len(files.eval))
    assert np.array_equal(read_rows(cached.eval.x, held_out), read_rows(files.eval.x, held_out))


def test_a_missing_or_stale_cache_is_one_line_naming_data_cache(tmp_path: Path) -> None:
    _folder(tmp_path / "photos")
    _folder(tmp_path / "held_out")
    missing = r"data.cache: .*photos.cache holds no decoded cache: write it with `crosstrain data cache PLAN`"
    with pytest.raises(PlanError, match=missing):
        load_datasets(_cache_plan(tmp_path))
    (tmp_path / "plan.toml").write_text(
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        '[data]\nsource = "images"\nimage_size = [8, 8]\npath = "photos"\neval_path = "held_out"\n'
        'cache = "photos.cache"\n'
    )
    assert _write_cache(tmp_path) == 0
    changed = tmp_path / "photos" / "ant" / "0.jpg"
    os.utime(changed, ns=(0, 0))
    with pytest.raises(PlanError, match=rf"stale: {changed} changed since it was written"):
        load_datasets(_cache_plan(tmp_path))
    _image(tmp_path / "photos" / "ant" / "9.png", 7)
    assert _write_cache(tmp_path) == 0  # rewritten: the new file and the changed one
    load_datasets(_cache_plan(tmp_path))


@pytest.mark.parametrize(
    ("data", "found"),
    [
        ('source = "npz"\npath = "x.npz"', "data.source: 'npz': only image files are cached"),
        ('source = "images"\npath = "photos"\nimage_size = [8, 8]', "data.cache: name the folder"),
    ],
)
def test_caching_a_plan_without_images_or_a_cache_folder_is_refused(
    tmp_path: Path, data: str, found: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plan.toml").write_text(
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        f"[data]\n{data}\n"
    )
    assert _write_cache(tmp_path) == 2
    assert found in capsys.readouterr().err


# --------------------------------------------------------------------------- mixup, cutmix


def _reference_mixing(seed: int, epoch: int, row: int, train_rows: int, size: tuple[int, int], alphas):
    """One row's partner, weight and cutmix box, by hand: the hash's draws 28..31, the Beta
    draw from numpy's generator seeded by (seed, epoch, row), torchvision's CutMix box."""
    mixup_alpha, cutmix_alpha = alphas
    partner = math.floor(_draw(seed, epoch, row, 28) * train_rows)
    cut = _draw(seed, epoch, row, 29) < 0.5 if mixup_alpha and cutmix_alpha else bool(cutmix_alpha)
    generator = np.random.default_rng([0x4D495831, seed, epoch, row])
    lam = float(generator.beta(*(2 * [cutmix_alpha if cut else mixup_alpha])))
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
    from crosstrain.core.planfile import load_plan

    source = 'source = "images"\npath = "photos"\nimage_size = [8, 8]' if setting else 'source = "digits"'
    (tmp_path / "plan.toml").write_text(
        f"{setting}\n"
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        f"[data]\n{source}\n[data.augment]\nmixup = 0.2\n"
    )
    with pytest.raises(PlanError, match=found):
        load_plan(tmp_path / "plan.toml")
