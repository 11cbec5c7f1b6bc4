"""The decoding workers: the rows their processes give against ``decode_image``, and each
failure's one line (a damaged file, a killed worker, too little shared memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.augment import Augmentation, uniforms
from crosstrain.core.data.sources import images
from crosstrain.core.data.sources.images import ImageRows, batches, decode_image
from crosstrain.core.errors import InputError
from tests.core.image_files import photographs

# --------------------------------------------------------------------------- the decoding workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("antialias", [True, False])
def test_the_worker_processes_give_the_rows_decode_image_gives_bit_for_bit(
    tmp_path: Path, two_workers, antialias: bool
) -> None:
    """An augmented batch (crop, flip, padded crop, jitter) cut between two workers equals
    ``decode_image`` called row by row here, read into a caller's buffer or not, and read
    ahead several batches at a time; resized by Pillow or by OpenCV."""
    augmentation = Augmentation(flip=True, crop_scale=(0.2, 1.0), pad_crop=2, color_jitter=(0.4, 0.4, 0.4))
    rows = ImageRows(photographs(tmp_path, 13), (16, 24), augmentation, seed=5, antialias=antialias)
    indices = np.array([12, 3, 7, 0, 9, 1, 11, 4, 2])
    draws = uniforms(5, 3, indices)
    expected = np.stack(
        [
            decode_image(rows.paths[row], (16, 24), augmentation, draws[k], antialias)
            for k, row in enumerate(indices)
        ]
    )
    assert np.array_equal(rows.read(indices, 3), expected)
    buffer = np.zeros_like(expected)
    assert rows.read(indices, 3, out=buffer) is buffer and np.array_equal(buffer, expected)
    plain = np.stack([decode_image(rows.paths[row], (16, 24), None, None, antialias) for row in indices])
    assert np.array_equal(rows.read(indices), plain)  # no epoch: the centre box
    order = [indices[:4], indices[4:], indices[::-1], indices[:1]]
    for got, batch in zip(batches(rows, order, epoch=3, ahead=3), order, strict=True):
        assert np.array_equal(got, expected[[list(indices).index(row) for row in batch]])
    assert images.decode_pool().workers[0].process.poll() is None  # one pool, still running


def test_a_decoding_worker_imports_no_framework() -> None:
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, crosstrain.core.data.sources.pool; "
         "print(sorted({'torch', 'tensorflow', 'jax', 'keras'} & set(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert imported.stdout.strip() == "[]"


@pytest.mark.timeout(120)
def test_a_damaged_file_mid_batch_is_one_line_naming_it(tmp_path: Path, two_workers) -> None:
    """Header sound, pixels cut short: the batch fails with the file named; the workers go on."""
    paths = photographs(tmp_path, 6)
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
    rows = ImageRows(photographs(tmp_path, 6), (8, 8))
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
    from crosstrain.core.data.sources import pool

    class Free:
        f_bavail, f_frsize = 1000, 4096  # 4 MB free

    monkeypatch.setattr(pool, "_SHM_FOLDER", str(tmp_path))
    monkeypatch.setattr(pool.os, "statvfs", lambda folder: Free())
    needed = r"has 4096000 bytes free; image decoding needs 38535168 .*--shm-size"
    with pytest.raises(InputError, match=needed):
        pool._shared_memory(256 * 224 * 224 * 3)
