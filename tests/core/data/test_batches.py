"""The global sampler and batches: crosstrain, not the framework, makes every batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.batches import ArrayDataset, GlobalSampler, epoch_slice, step_batch
from crosstrain.core.errors import PlanError
from crosstrain.core.run.loading import load_datasets, load_digits_arrays
from crosstrain.core.spec.planfile import load_plan


def test_every_row_exactly_once_per_epoch_and_padding_weighs_zero() -> None:
    sampler = GlobalSampler(num_rows=103, global_batch_size=16, seed=1)
    for epoch in range(3):
        batches = list(sampler.epoch(epoch))
        assert len(batches) == sampler.steps_per_epoch == 7
        assert all(len(indices) == 16 for indices, _ in batches)
        real = np.concatenate([indices[weight == 1] for indices, weight in batches])
        assert sorted(real.tolist()) == list(range(103))
        assert sum(int((weight == 0).sum()) for _, weight in batches) == 7 * 16 - 103


def test_epochs_are_shuffled_differently_but_reproducibly() -> None:
    sampler = GlobalSampler(num_rows=50, global_batch_size=10, seed=4)
    first = np.concatenate([i for i, _ in sampler.epoch(0)])
    assert not np.array_equal(first, np.concatenate([i for i, _ in sampler.epoch(1)]))
    assert np.array_equal(first, np.concatenate([i for i, _ in sampler.epoch(0)]))


def test_processes_split_each_micro_batch_contiguously() -> None:
    dataset = ArrayDataset(np.arange(32, dtype=np.float32).reshape(16, 2), np.arange(16))
    indices, weight = np.arange(16), np.ones(16, np.float32)
    parts = [step_batch(dataset, indices, weight, p, 2, grad_accum_steps=2) for p in range(2)]
    assert [m.y.tolist() for m in parts[0].micro_batches] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert [m.y.tolist() for m in parts[1].micro_batches] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert parts[0].global_real_rows == parts[1].global_real_rows == 16


def test_each_full_batch_and_its_parts_are_slices_of_the_epochs_order() -> None:
    """What lets a backend copy the epoch's order to the device once and slice it there."""
    dataset = ArrayDataset(np.zeros((20, 2), np.float32), np.zeros(20, np.int64))
    sampler = GlobalSampler(num_rows=20, global_batch_size=8, seed=3)
    batches = list(sampler.epoch(0))
    order, start = epoch_slice(batches[1][0]) or (None, -1)
    assert order is not None and start == 8 and np.array_equal(order[8:16], batches[1][0])
    for process in range(2):  # each process's part of each micro-batch, at its offset
        for micro in step_batch(dataset, *batches[1], process, 2, grad_accum_steps=2).micro_batches:
            assert micro.source is not None
            found = epoch_slice(micro.source.indices)
            assert found is not None and found[0] is order
            assert np.array_equal(order[found[1] : found[1] + 2], micro.source.indices)
    assert epoch_slice(batches[2][0]) is None  # the padded last batch is a copy
    assert epoch_slice(np.arange(8)[::2]) is None  # strided: not a slice


def test_digits_is_real_data_split_by_seed(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan())
    data = load_datasets(plan)
    assert data.eval is not None
    assert len(data.train) + len(data.eval) == 1797
    assert data.train.x.shape[1:] == (64,) and data.train.x.min() >= 0.0 and data.train.x.max() <= 1.0
    assert set(np.unique(data.train.y)) == set(range(10))


def test_digits_are_scikit_learns_own_rows_without_importing_it() -> None:
    """The shipped CSV read directly gives load_digits' rows and labels, scaled by 1/16."""
    from sklearn.datasets import load_digits

    x, y = load_digits_arrays()
    expected_x, expected_y = load_digits(return_X_y=True)
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x, (expected_x / 16.0).astype(np.float32)) and np.array_equal(y, expected_y)


def test_digits_reshape_to_image_input(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(
        write_plan(),
        ["model.input_shape=[8, 8, 1]", "model.layers=[{type='flatten'},{type='dense', units=10}]"],
    )
    assert load_datasets(plan).train.x.shape[1:] == (8, 8, 1)


def test_npz_errors_name_the_field(write_plan: Callable[..., Path], odd_npz: Path) -> None:
    plan = load_plan(write_plan(), ["data.source='npz'", f"data.path='{odd_npz}'", "data.y_key='labels'"])
    with pytest.raises(PlanError, match=r"data.y_key: .*no array 'labels'"):
        load_datasets(plan)
    plan = load_plan(write_plan(), ["data.source='npz'", f"data.path='{odd_npz}'", "model.input_shape=[32]"])
    with pytest.raises(PlanError, match=r"data.path: rows have shape \[64\].*input_shape \[32\]"):
        load_datasets(plan)


def test_labels_beyond_the_output_layer_are_refused(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan(), ["model.layers=[{type='dense', units=5}]"])
    with pytest.raises(PlanError, match=r"labels span 0\.\.9 but the model's last layer has 5 units"):
        load_datasets(plan)


def _broken_npz(path: Path, case: str) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 64)).astype(np.float32), rng.integers(0, 10, size=40)
    if case == "uneven":
        y = y[:30]
    if case == "nonfinite":
        x[7, 3] = np.nan
    if case == "empty":
        x, y = x[:0], y[:0]
    np.savez(path, x=x, y=y)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:300])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("truncated", r"data.path: cannot read .*bad.npz"),
        ("uneven", r"data.path: .*bad.npz: x has 40 rows but y has 30"),
        ("nonfinite", r"data.path: .*bad.npz: x holds 1 non-finite values"),
        ("empty", r"data: the training set is empty"),
    ],
)
def test_bad_data_files_are_refused_at_load_naming_the_file(
    write_plan: Callable[..., Path], tmp_path: Path, case: str, message: str
) -> None:
    _broken_npz(tmp_path / "bad.npz", case)
    plan = load_plan(write_plan(), ["data.source='npz'", f"data.path='{tmp_path / 'bad.npz'}'"])
    with pytest.raises(PlanError, match=message):
        load_datasets(plan)


@pytest.fixture
def mnist_like(tmp_path: Path) -> Path:
    """An .npz laid out as Keras's mnist.npz: uint8 images, train and test arrays in one file."""
    rng = np.random.default_rng(5)
    path = tmp_path / "mnist.npz"
    np.savez(
        path,
        x_train=rng.integers(0, 256, (60, 8, 8), dtype=np.uint8),
        y_train=rng.integers(0, 10, 60),
        x_test=rng.integers(0, 256, (24, 8, 8), dtype=np.uint8),
        y_test=rng.integers(0, 10, 24),
    )
    return path


def _mnist_plan(path: Path, *overrides: str) -> list[str]:
    return [
        "model.input_shape=[8, 8, 1]",
        "model.layers=[{type='flatten'}, {type='dense', units=10}]",
        "data.source='npz'",
        f"data.path='{path}'",
        "data.x_key='x_train'",
        "data.y_key='y_train'",
        *overrides,
    ]


def test_the_eval_set_is_read_from_the_same_npz_by_its_keys(
    write_plan: Callable[..., Path], mnist_like: Path
) -> None:
    keys = ["data.eval_x_key='x_test'", "data.eval_y_key='y_test'", "data.scale=0.00390625"]
    datasets = load_datasets(load_plan(write_plan(), _mnist_plan(mnist_like, *keys)))
    assert datasets.eval is not None and len(datasets.train) == 60 and len(datasets.eval) == 24
    with np.load(mnist_like) as arrays:
        expected = arrays["x_test"].reshape(24, 8, 8, 1).astype(np.float32) / 256
        assert np.array_equal(datasets.eval.x[np.arange(24)], expected)
        assert np.array_equal(datasets.eval.y, arrays["y_test"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.eval_x_key='x_tst'", "data.eval_y_key='y_test'"],
            r"data\.eval_x_key: .*mnist\.npz has no array 'x_tst'; did you mean 'x_test'\? "
            r"\(it has x_train, y_train, x_test, y_test\)$",
        ),
        (["data.eval_x_key='x_test'"], r"data: eval_x_key and eval_y_key come together$"),
        (
            ["data.eval_x_key='x_test'", "data.eval_y_key='y_test'", "data.source='digits'"],
            r"data: eval_x_key and eval_y_key name arrays of an \.npz file .* not of source 'digits'$",
        ),
    ],
)
def test_npz_eval_keys_are_checked_naming_the_key_and_file(
    write_plan: Callable[..., Path], mnist_like: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        load_datasets(load_plan(write_plan(), _mnist_plan(mnist_like, *overrides)))


def test_a_dense_layer_on_an_image_is_named_with_the_flatten_it_lacks(
    write_plan: Callable[..., Path],
) -> None:
    """Keras's Dense, like crosstrain's, acts on the last axis: after a convolution and a
    pooling with no flatten, the logits keep the image's height and width."""
    layers = (
        "[{type='conv2d', filters=4, kernel_size=3, activation='relu'}, {type='maxpool2d'},"
        " {type='dense', units=10}]"
    )
    plan = load_plan(write_plan(), ["model.input_shape=[8, 8, 1]", f"model.layers={layers}"])
    with pytest.raises(PlanError) as refused:
        load_datasets(plan)
    assert str(refused.value).endswith(
        "model.layers[2]: labels have shape [] per row but the model's logits need [3, 3]: this dense "
        'layer reads an image [3, 3, 4] and acts on its last axis only; add { type = "flatten" } before it'
    )
