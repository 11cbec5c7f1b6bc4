"""Token data: windows read by index from a memory map, and the python-stdlib corpus."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.tokens import stdlib_files
from crosstrain.core.errors import PlanError
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import write_tokens
from crosstrain.testing.plans import GPT_PLAN


def test_windows_are_next_token_pairs_read_from_a_memory_map(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    write_tokens(str(tmp_path / "tokens.npy"), count=1001)
    data = load_datasets(load_plan(write_plan(GPT_PLAN)))
    tokens = np.load(tmp_path / "tokens.npy")
    assert isinstance(data.train.x.tokens, np.memmap)  # type: ignore[attr-defined]
    assert (len(data.train), len(data.eval)) == (56, 6)  # 62 windows of 16: the last 10 % held out
    x, y = data.train.x[np.array([3, 0])], data.train.y[np.array([3, 0])]
    assert x.dtype == np.int32 and y.dtype == np.int64 and x.shape == (2, 16)
    assert np.array_equal(x[0], tokens[48:64]) and np.array_equal(y[0], tokens[49:65])
    assert np.array_equal(data.eval.x[np.array([0])][0], tokens[56 * 16 : 57 * 16])  # type: ignore[union-attr]
    assert data.train.targets_per_row == 16


def test_token_ids_beyond_the_vocabulary_name_the_file(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(500) % 40)
    with pytest.raises(
        PlanError, match=r"data\.path: token ids reach 39 but the model's last layer has 32 classes"
    ):
        load_datasets(load_plan(write_plan(GPT_PLAN)))


def test_a_token_file_must_be_1d_integers(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", np.zeros((10, 2), np.float32))
    with pytest.raises(PlanError, match=r"data\.path: .*tokens are a 1-D integer array"):
        load_datasets(load_plan(write_plan(GPT_PLAN)))


def test_the_stdlib_corpus_is_sorted_source_without_tests_or_site_packages(
    write_plan: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = stdlib_files()
    names = [path.as_posix() for path in files]
    assert len(files) > 300 and any(name.endswith("/json/decoder.py") for name in names)
    assert not any("/test/" in name or "/site-packages/" in name for name in names)
    monkeypatch.setenv("CROSSTRAIN_CACHE", str(tmp_path / "cache"))
    text = (
        GPT_PLAN.replace('source = "tokens"\npath = "tokens.npy"', 'source = "python-stdlib"')
        .replace("vocab_size = 32", "vocab_size = 256")
        .replace('{ type = "dense", units = 32 },\n]', '{ type = "dense", units = 256 },\n]')
    )
    data = load_datasets(load_plan(write_plan(text), ["data.limit=100"]))
    assert (len(data.train), len(data.eval)) == (90, 10)
    first = files[0].read_bytes()[:16]
    assert bytes(data.train.x[np.array([0])][0].astype(np.uint8)) == first
    assert list((tmp_path / "cache").glob("python-stdlib-*.npy"))  # cached for every worker
