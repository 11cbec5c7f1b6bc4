"""The decoded cache (``crosstrain data cache PLAN``): rows read from it are the rows the
files give; a missing or stale one is refused naming data.cache."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import numpy as np
import pytest

from crosstrain.core.data.rows import read_rows
from crosstrain.core.data.sources.images import (
    ImageRows,
)
from crosstrain.core.errors import PlanError
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan import Plan
from tests.core.image_files import image_plan, write_folder, write_image

# --------------------------------------------------------------------------- the decoded cache


def _cache_plan(tmp_path: Path) -> Plan:
    return image_plan(
        tmp_path,
        'path = "photos"\neval_path = "held_out"\ncache = "photos.cache"\n'
        "[data.augment]\nflip = true\ncrop_scale = [0.3, 1.0]\npad_crop = 1\ncolor_jitter = [0.4, 0.4, 0.4]",
    )


def _write_cache(tmp_path: Path) -> int:
    from crosstrain.cli import main

    return main(["data", "cache", str(tmp_path / "plan.toml")])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("antialias", [True, False])
def test_rows_read_from_the_decoded_cache_are_the_rows_decoded_from_the_files(
    tmp_path: Path, two_workers, capsys: pytest.CaptureFixture[str], antialias: bool
) -> None:
    """``crosstrain data cache PLAN`` decodes every training and held-out file once; a run of
    the plan then reads them from it: augmented and centre-boxed rows bit for bit those the
    files give, resized by Pillow or by OpenCV (these 12x10 images never decode at a reduced
    JPEG scale)."""
    write_folder(tmp_path / "photos")
    write_folder(tmp_path / "held_out")
    (tmp_path / "plan.toml").write_text(
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        '[data]\nsource = "images"\nimage_size = [8, 8]\npath = "photos"\neval_path = "held_out"\n'
        'cache = "photos.cache"\n'
    )
    assert _write_cache(tmp_path) == 0
    assert "18 images decoded" in capsys.readouterr().out
    cached_plan = _cache_plan(tmp_path)
    cached_plan = attrs.evolve(cached_plan, data=attrs.evolve(cached_plan.data, antialias=antialias))
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
    write_folder(tmp_path / "photos")
    write_folder(tmp_path / "held_out")
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
    write_image(tmp_path / "photos" / "ant" / "9.png", 7)
    assert _write_cache(tmp_path) == 0  # rewritten: the new file and the changed one
    load_datasets(_cache_plan(tmp_path))


def test_a_cache_that_fails_midway_leaves_the_folder_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A JPEG whose header opens but whose pixels are cut short: ``data cache`` exits 2 in
    one line naming it and writes nothing, neither a folder where there was none nor over a
    cache already there, which stays whole."""
    write_folder(tmp_path / "photos")
    write_folder(tmp_path / "held_out")
    (tmp_path / "plan.toml").write_text(
        '[model]\ninput_shape = [8, 8, 3]\nlayers = [{ type = "flatten" }, { type = "dense", units = 3 }]\n'
        '[data]\nsource = "images"\nimage_size = [8, 8]\npath = "photos"\ncache = "made/photos.cache"\n'
    )
    damaged = tmp_path / "photos" / "ant" / "2.jpg"
    whole = damaged.read_bytes()
    cut = whole[: whole.index(b"\xff\xda") + 20]  # cut inside the pixels
    damaged.write_bytes(cut)
    assert _write_cache(tmp_path) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"crosstrain: error: cannot decode image {damaged}: "), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["held_out", "photos", "plan.toml"]
    damaged.write_bytes(whole)
    assert _write_cache(tmp_path) == 0
    cache = tmp_path / "made" / "photos.cache"
    written = {path.name: path.read_bytes() for path in cache.iterdir()}
    damaged.write_bytes(cut)
    assert _write_cache(tmp_path) == 2
    assert {path.name: path.read_bytes() for path in cache.iterdir()} == written
    assert [path.name for path in (tmp_path / "made").iterdir()] == ["photos.cache"]  # nothing beside it


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
