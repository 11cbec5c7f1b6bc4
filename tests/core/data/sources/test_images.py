"""The images source without a framework: the folder and index loaders, rows decoded to the
image size, and each bad input's one line."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.admission.checks import check_image_files
from crosstrain.core.data.rows import read_rows
from crosstrain.core.data.sources.images import (
    ImageRows,
    batches,
    check_image_headers,
    read_image_index,
)
from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan_dicts import structure_plan
from crosstrain.testing.data_plans import damaged_png
from tests.core.image_files import image_plan, write_folder, write_image


def test_a_folder_and_its_index_give_the_same_rows_classes_sorted_by_name(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "photos")
    index = read_image_index(str(root), "data.path", None)
    assert index.classes == ("Bee", "ant", "zebra")  # by name (code points)
    lines = ["label,path"] + [f"{Path(p).parent.name},{Path(p).relative_to(tmp_path)}" for p in index.paths]
    (tmp_path / "index.csv").write_text("\n".join(lines) + "\n")
    listed = read_image_index(str(tmp_path / "index.csv"), "data.path", None)
    assert listed.paths == index.paths and listed.classes == index.classes
    assert np.array_equal(listed.labels, index.labels)
    assert index.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_rows_decode_to_the_image_size_and_training_rows_are_augmented_per_epoch(tmp_path: Path) -> None:
    write_folder(tmp_path / "photos")
    plan = image_plan(
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
    write_folder(tmp_path / "photos")
    (tmp_path / "empty").mkdir()
    write_folder(tmp_path / "photos_with_empty")
    (tmp_path / "photos_with_empty" / "cat").mkdir()
    (tmp_path / "bad.csv").write_text("path,kind\nphotos/ant/0.jpg,ant\n")
    write_image(tmp_path / "other" / "wolf" / "0.png", 3)
    with pytest.raises(PlanError) as raised:
        load_datasets(image_plan(tmp_path, data))
    assert found in str(raised.value) and "\n" not in str(raised.value)


def test_an_unreadable_image_and_a_misfit_model_are_named(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "photos")
    (root / "ant" / "9.jpg").write_bytes(b"not an image at all")
    plan = image_plan(tmp_path, 'path = "photos"')
    with pytest.raises(PlanError, match=r"data\.path: cannot read image .*ant/9\.jpg"):
        check_image_files(plan, load_datasets(plan))
    misfit = r"model\.input_shape: \[64\], but images of data\.image_size \[8, 8\] are rows \[8, 8, 3\]"
    with pytest.raises(PlanError, match=misfit):
        load_datasets(image_plan(tmp_path, 'path = "photos"', input_shape="[64]"))


def test_an_image_cut_short_is_refused_before_launch_and_a_whole_one_is_not(tmp_path: Path) -> None:
    """A JPEG or PNG cut inside its pixels opens (its header is whole), but lacks its
    format's end: the admission decodes it and names it. Bytes after a JPEG's end (a
    writer's padding) and damage inside a whole PNG pass: the second is met mid-run."""
    root = write_folder(tmp_path / "photos")
    plan = image_plan(tmp_path, 'path = "photos"')
    padded = root / "ant" / "0.jpg"
    padded.write_bytes(padded.read_bytes() + b"\x00" * 100)
    broken_stream = root / "ant" / "1.png"
    broken_stream.write_bytes(damaged_png(broken_stream.read_bytes()))
    check_image_files(plan, load_datasets(plan))
    for cut, marker in ((root / "Bee" / "2.jpg", b"\xff\xda"), (root / "zebra" / "1.png", b"IDAT")):
        whole = cut.read_bytes()
        cut.write_bytes(whole[: whole.index(marker) + 20])
        with pytest.raises(PlanError, match=rf"data\.path: cannot read image {cut}: image file is truncated"):
            check_image_files(plan, load_datasets(plan))
        cut.write_bytes(whole)


@pytest.mark.parametrize(
    ("data", "found"),
    [
        ('image_size = [8, 8]\nplacement = "device"', "data: data.placement 'device'"),
        ('source = "digits"\n[data.augment]\nflip = true', "data.augment transforms images"),
        ("[data.augment]\ncrop_scale = [0.5, 0.2]", "data.augment.crop_scale: must be [lo, hi]"),
        ("[data.augment]\ncolor_jitter = [0.4, -1, 0]", "data.augment.color_jitter: must be"),
        ("", "source 'images' needs data.image_size"),
        ('source = "digits"\nantialias = false', "data.antialias is how images are resized"),
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

    root = write_folder(tmp_path / "photos")
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
    write_folder(tmp_path / "photos")
    plan = image_plan(
        tmp_path, 'path = "photos"\neval_fraction = 0.0\n[data.augment]\ncrop_scale = [0.3, 1.0]'
    )
    rows = load_datasets(plan).train.x
    assert isinstance(rows, ImageRows)
    order = [np.array([4, 0, 8]), np.array([1, 2]), np.array([7, 3, 5, 6])]
    for got, indices in zip(batches(rows, order, epoch=2, ahead=1), order, strict=True):
        assert np.array_equal(got, rows.read(indices, 2))


def test_no_pillow_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if not installed
    with pytest.raises(InputError, match=r"needs Pillow: pip install 'crosstrain\[images\]'"):
        check_image_headers([str(tmp_path / "a.jpg")], "data.path", None)
