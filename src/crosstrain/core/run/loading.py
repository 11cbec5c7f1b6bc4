"""A plan's data sets, loaded from its source (``data.source``: the digits, ``.npz``,
memory-mapped ``.npy``, tokens, the Python standard library, image files, tables and text),
every check of the data against the model made here, before any process starts; the types
they load into, and the sampler that cuts them into steps, are :mod:`crosstrain.core.data.batches`'s.
"""

from __future__ import annotations

import importlib.util
import math
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from crosstrain.core.data.batches import ArrayDataset, Datasets
from crosstrain.core.data.mapped import MappedRows, map_npy
from crosstrain.core.data.rows import Rows
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.data.sources import table as tables
from crosstrain.core.data.sources import text
from crosstrain.core.data.sources.cache import CachedRows, cached_rows
from crosstrain.core.data.sources.images import ImageRows, MixedTargets, check_classes, read_image_index
from crosstrain.core.data.tokens import TokenWindows, load_token_file, python_stdlib_tokens, stdlib_files
from crosstrain.core.errors import InputError, PlanError, closest_name
from crosstrain.core.model.graph import MODEL_INPUT
from crosstrain.core.model.layers import Embedding
from crosstrain.core.run.targets import TargetMisfit, fit_targets, fit_to_input, plan_targets
from crosstrain.core.spec.data_spec import DataSpec
from crosstrain.core.spec.plan import CLASS_LOSSES, Plan, output_shape


def load_datasets(plan: Plan, run_dir: str | Path | None = None) -> Datasets:
    """Load and shape the plan's data, checking it against the model; errors name the field.
    Inputs come out scaled as ``data.scale``/``mean``/``std`` ask, read raw until then.
    ``run_dir``: a run folder whose kept statistics (a table's codes, mean and std) are used
    as they are; without it (or where it keeps none) they are computed from the rows."""
    if plan.data.source == "table":
        datasets, statistics = table_datasets(plan, run_dir)
        scaled = _scaled(datasets, statistics.scaling() if plan.data.standardize else plan.data.scaling)
        return attrs.evolve(scaled, statistics=statistics)
    return _scaled(_load_raw_datasets(plan), plan.data.scaling)


def _scaled(datasets: Datasets, scaling: InputScaling) -> Datasets:
    if scaling.is_identity:
        return datasets
    train = ArrayDataset(ScaledRows(datasets.train.x, scaling), datasets.train.y)
    if datasets.eval is None:
        return Datasets(train=train, eval=None)
    return Datasets(train=train, eval=ArrayDataset(ScaledRows(datasets.eval.x, scaling), datasets.eval.y))


def _load_raw_datasets(plan: Plan) -> Datasets:
    spec = plan.data
    if spec.source in ("tokens", "python-stdlib", "text"):
        return _token_datasets(plan)
    if spec.source == "images":
        return _image_datasets(plan)
    if spec.source == "npy":
        return _npy_datasets(plan)
    x, y = _load_arrays(spec, spec.path, plan.source)
    _check_rows(x, y, spec.path, "data.path", plan.source)
    if spec.limit is not None:
        x, y = x[: spec.limit], y[: spec.limit]
    x = fit_to_input(x, plan, "data.path" if spec.source == "npz" else "data.source")
    y = plan_targets(y, plan)
    full = ArrayDataset(x, y)
    evaluation = _npz_eval_set(plan)
    if evaluation is not None:
        return _nonempty(Datasets(train=full, eval=evaluation), plan)
    return _nonempty(_split(full, spec.eval_fraction, plan.seed), plan)


def table_datasets(plan: Plan, run_dir: str | Path | None = None) -> tuple[Datasets, tables.TableStatistics]:
    """A table's train and eval sets (raw: numbers and category codes, float32) and its
    statistics: those ``run_dir`` keeps, else computed (codes from every row of the file,
    mean and std from the training rows)."""
    spec = plan.data
    assert spec.path is not None and spec.label is not None  # DataSpec refuses a table without them
    _check_table_model(plan)
    columns = _table_spec(plan)
    where = tables.Columns(spec.path, "data.path", plan.source)
    table = tables.read_table(spec.path, [*columns.features, columns.label], where, columns.categorical)
    kept = tables.read_statistics(run_dir)
    if kept is not None:
        tables.check_statistics_fit(kept, columns, where)
        categories, label_classes = kept.categories, kept.label_classes
    else:
        categories, label_classes = tables.read_codes(table, columns, where)
    full = _table_rows(plan, table, columns, categories, label_classes, where)
    if spec.limit is not None:
        full = full.take(np.arange(min(spec.limit, len(full))))
    if spec.eval_path is not None:
        where = tables.Columns(spec.eval_path, "data.eval_path", plan.source)
        evaluation = tables.read_table(
            spec.eval_path, [*columns.features, columns.label], where, columns.categorical
        )
        datasets = Datasets(full, _table_rows(plan, evaluation, columns, categories, label_classes, where))
    else:
        datasets = _split(full, spec.eval_fraction, plan.seed)
    datasets = _nonempty(datasets, plan)
    train_x = np.asarray(datasets.train.x[np.arange(len(datasets.train))])
    statistics = kept or tables.compute_statistics(train_x, columns, categories, label_classes)
    return datasets, statistics


def read_table_rows(
    plan: Plan, path: str, run_dir: str | Path, field: str, with_label: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of another table (``crosstrain evaluate``/``predict --data``) coded and scaled
    as the run's training rows were, by its kept statistics; and its labels if asked."""
    columns = _table_spec(plan)
    statistics = tables.read_statistics(run_dir) or table_datasets(plan)[1]
    where = tables.Columns(path, field, None)
    wanted = [*columns.features, columns.label] if with_label else list(columns.features)
    table = tables.read_table(path, wanted, where, columns.categorical)
    x = tables.encode_features(table, columns, statistics.categories, where)
    scaling = statistics.scaling() if plan.data.standardize else plan.data.scaling
    if not with_label:
        return scaling.apply(x), None
    y = tables.encode_label(table, columns, statistics.label_classes, where)
    return scaling.apply(x), _table_targets(y, plan, where)


def _table_spec(plan: Plan) -> tables.TableSpec:
    spec = plan.data
    assert spec.label is not None
    return tables.TableSpec(spec.features, spec.label, spec.categorical, plan.loss.name in CLASS_LOSSES)


def _check_table_model(plan: Plan) -> None:
    """One input per feature column, as float32 numbers."""
    features = plan.data.features
    _check_float_input(
        plan,
        (len(features),),
        f"data.features names {len(features)} columns: the model reads [{len(features)}] "
        "(one number per feature)",
        "a table's features are float32 numbers (categories as their codes)",
    )


def _check_float_input(plan: Plan, needed: tuple[int, ...], why_shape: str, why_dtype: str) -> None:
    """The model reads float32 rows of shape ``needed`` (a table's, an image source's), or
    a PlanError naming model.input_shape or model.input_dtype and why."""
    if tuple(plan.model.input_shape) != needed:
        raise PlanError(
            f"{list(plan.model.input_shape)}, but {why_shape}", field="model.input_shape", source=plan.source
        )
    if plan.model.input_dtype != "float32":
        raise PlanError(why_dtype, field="model.input_dtype", source=plan.source)


def _table_rows(
    plan: Plan,
    table: Any,
    columns: tables.TableSpec,
    categories: dict[str, tuple[str, ...]],
    label_classes: tuple[str, ...] | None,
    where: tables.Columns,
) -> ArrayDataset:
    x = tables.encode_features(table, columns, categories, where)
    y = tables.encode_label(table, columns, label_classes, where)
    return ArrayDataset(x, _table_targets(y, plan, where))


def _table_targets(y: np.ndarray, plan: Plan, where: tables.Columns) -> np.ndarray:
    """The label column against the model's output, refused naming the column."""
    try:
        return fit_targets(y, plan)
    except TargetMisfit as misfit:
        field = "data.label" if misfit.field == "data.y_key" else misfit.field
        field = field if where.field.startswith("data.") else where.field  # --data: the flag
        raise PlanError(
            f"{where.path}: column {plan.data.label!r}: {misfit}", field=field, source=where.source
        ) from None


def _npz_eval_set(plan: Plan) -> ArrayDataset | None:
    """The eval set of an npz plan: ``eval_path``'s arrays, or the eval keys' arrays of
    ``path`` (Keras's mnist.npz: x_test, y_test beside x_train, y_train); None: split."""
    spec = plan.data
    if spec.eval_path is None and spec.eval_x_key is None:
        return None
    path, field = (
        (spec.eval_path, "data.eval_path") if spec.eval_path is not None else (spec.path, "data.path")
    )
    keys = (spec.eval_x_key or spec.x_key, spec.eval_y_key or spec.y_key)
    key_fields = ("data.eval_x_key", "data.eval_y_key") if spec.eval_x_key else ("data.x_key", "data.y_key")
    eval_x, eval_y = _read_npz(path, keys, key_fields, field, plan.source)
    rows_field = key_fields[0] if spec.eval_path is None else field
    _check_rows(eval_x, eval_y, path, rows_field, plan.source)
    return ArrayDataset(fit_to_input(eval_x, plan, rows_field), plan_targets(eval_y, plan))


def _check_rows(x: np.ndarray, y: np.ndarray, path: str | None, field: str, source: str | None) -> None:
    """x and y of one file: as many rows each, and finite (a NaN in the inputs would turn
    every loss into NaN at the first step that draws it)."""
    where = path or "the data set"
    if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
        rows = [len(a) if a.ndim else 0 for a in (x, y)]
        raise PlanError(f"{where}: x has {rows[0]} rows but y has {rows[1]}", field=field, source=source)
    for name, values in (("x", x), ("y", y)):
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            bad = int(np.count_nonzero(~np.isfinite(values)))
            raise PlanError(
                f"{where}: {name} holds {bad} non-finite values (NaN or inf)", field=field, source=source
            )


def _nonempty(datasets: Datasets, plan: Plan) -> Datasets:
    if len(datasets.train) == 0:
        raise PlanError("the training set is empty: nothing to train on", field="data", source=plan.source)
    return datasets


def _npy_datasets(plan: Plan) -> Datasets:
    """x and y memory-mapped, checked against the model without reading x."""
    spec = plan.data
    full = _mapped_dataset(plan, spec.x_path, spec.y_path, "data.x_path", "data.y_path")
    if spec.limit is not None:
        full = full.take(np.arange(min(spec.limit, len(full))))
    if spec.eval_x_path is not None:
        evaluation = _mapped_dataset(
            plan, spec.eval_x_path, spec.eval_y_path, "data.eval_x_path", "data.eval_y_path"
        )
        return _nonempty(Datasets(train=full, eval=evaluation), plan)
    return _nonempty(_split(full, spec.eval_fraction, plan.seed), plan)


def _mapped_dataset(
    plan: Plan, x_path: str | None, y_path: str | None, x_field: str, y_field: str
) -> ArrayDataset:
    x = map_npy(x_path, x_field, plan.source)
    y = map_npy(y_path, y_field, plan.source)
    if len(x) != len(y):
        raise PlanError(
            f"{x_path} has {len(x)} rows but {y_path} has {len(y)}", field=y_field, source=plan.source
        )
    shape = plan.model.input_shape
    if math.prod(x.shape[1:]) != math.prod(shape):
        raise PlanError(
            f"rows have shape {list(x.shape[1:])}, which does not fit model.input_shape {list(shape)}",
            field=x_field,
            source=plan.source,
        )
    dtype = np.int32 if plan.model.input_dtype == "int32" else np.float32
    # the targets are small (labels) or as large as the outputs: checked and kept in memory
    return ArrayDataset(MappedRows(x, tuple(shape), dtype), plan_targets(np.asarray(y), plan))


def _token_datasets(plan: Plan) -> Datasets:
    """Windows of a token file (memory-mapped, never loaded whole); the eval set is the last
    ``eval_fraction`` of the windows, so no eval text is ever trained on."""
    spec = plan.data
    assert spec.sequence_length is not None  # DataSpec refuses token sources without it
    tokens = _tokens(plan)
    length = spec.sequence_length
    _check_token_model(plan, tokens, length)
    windows = (len(tokens) - 1) // length
    if spec.limit is not None:
        windows = min(windows, spec.limit)
    eval_windows = max(1, round(windows * spec.eval_fraction)) if spec.eval_fraction > 0 else 0
    if windows - eval_windows < 1:
        raise PlanError(
            f"{len(tokens)} tokens make {windows} windows of {length}: too few to train on",
            field="data.sequence_length",
            source=plan.source,
        )

    def part(first: int, count: int) -> ArrayDataset:
        return ArrayDataset(
            TokenWindows(tokens, length, first, count, offset=0, dtype=np.int32),
            TokenWindows(tokens, length, first, count, offset=1, dtype=np.int64),
        )

    train_windows = windows - eval_windows
    evaluation = part(train_windows, eval_windows) if eval_windows else None
    # a window moved right by up to L-1 tokens would read into the next one: the last
    # training window is left out, so no moved window reaches the eval text (or the end)
    moved = 1 if spec.augment.window_offset else 0
    if train_windows - moved < 1:
        raise PlanError(
            f"{len(tokens)} tokens make {windows} windows of {length}: too few to train on "
            "with augment.window_offset (which leaves the last training window out)",
            field="data.sequence_length",
            source=plan.source,
        )
    return Datasets(train=part(0, train_windows - moved), eval=evaluation)


def epoch_rows(dataset: ArrayDataset, plan: Plan, epoch: int) -> ArrayDataset:
    """The training rows as epoch ``epoch`` reads them: with ``data.augment.window_offset``
    each token window moved by its draw for the epoch; otherwise the rows themselves."""
    if not plan.data.augment.window_offset or not isinstance(dataset.x, TokenWindows):
        return dataset
    assert isinstance(dataset.y, TokenWindows)
    shifts = text.window_offsets(plan.seed, epoch, np.arange(len(dataset)), dataset.x.length)
    return ArrayDataset(text.ShiftedWindows(dataset.x, shifts), text.ShiftedWindows(dataset.y, shifts))


def _tokens(plan: Plan) -> np.ndarray:
    """The plan's token array: a token file, or text (the standard library's or the files
    of ``data.path``) as bytes or through ``data.tokenizer``, tokenized once into the cache."""
    spec = plan.data
    if spec.source == "python-stdlib" and spec.tokenizer is None:
        return python_stdlib_tokens()
    if spec.source == "tokens":
        assert spec.path is not None
        return load_token_file(spec.path, plan.source)
    where = text.Where("data.path" if spec.source == "text" else "data.source", plan.source)
    files = stdlib_files() if spec.source == "python-stdlib" else text.text_files(str(spec.path), where)
    if spec.tokenizer is not None:
        _check_vocabulary(plan, text.vocabulary_size(spec.tokenizer))
    return text.corpus_tokens(files, spec.tokenizer, where)


def _check_vocabulary(plan: Plan, vocabulary: int) -> None:
    """Every id the tokenizer can give has an embedding row and an output class."""
    if plan.model.native is not None:
        return
    graph = plan.model.graph(plan.source)
    tokenizer = f"the tokenizer's vocabulary ({vocabulary} ids, {plan.data.tokenizer})"
    for node in graph.nodes:
        if (
            isinstance(node.layer, Embedding)
            and MODEL_INPUT in node.inputs
            and node.layer.vocab_size < vocabulary
        ):
            raise PlanError(
                f"vocab_size {node.layer.vocab_size} is smaller than {tokenizer}",
                field=f"{node.field}.vocab_size",
                source=plan.source,
            )
    classes = graph.output_shape[-1] if graph.output_shape else 0
    if plan.loss.name in CLASS_LOSSES and classes < vocabulary:
        raise PlanError(
            f"the model's last layer has {classes} classes, fewer than {tokenizer}",
            field="model.layers",
            source=plan.source,
        )


def _image_datasets(plan: Plan) -> Datasets:
    """Image files listed (not decoded: a step decodes its rows), labelled by their
    classes sorted by name; training rows augmented as ``data.augment`` says."""
    spec = plan.data
    assert spec.path is not None and spec.image_size is not None  # DataSpec refuses images without
    _check_image_model(plan)
    index = read_image_index(spec.path, "data.path", plan.source)
    rows = ImageRows(
        np.asarray(index.paths), spec.image_size, cached=_cached(plan, index.paths), antialias=spec.antialias
    )
    full = ArrayDataset(rows, plan_targets(index.labels, plan))
    if spec.limit is not None:
        full = full.take(np.arange(min(spec.limit, len(full))))
    if spec.eval_path is not None:
        held_out = read_image_index(spec.eval_path, "data.eval_path", plan.source)
        check_classes(index.classes, held_out.classes, "data.eval_path", plan.source)
        label_of = {name: label for label, name in enumerate(index.classes)}
        labels = np.asarray([label_of[held_out.classes[label]] for label in held_out.labels], np.int64)
        cached = _cached(plan, held_out.paths)
        rows = ImageRows(np.asarray(held_out.paths), spec.image_size, cached=cached, antialias=spec.antialias)
        datasets = Datasets(train=full, eval=ArrayDataset(rows, plan_targets(labels, plan)))
    else:
        datasets = _split(full, spec.eval_fraction, plan.seed)
    train = datasets.train
    assert isinstance(train.x, ImageRows)
    images = train.x.augmented(spec.augment, plan.seed)
    targets: Rows = MixedTargets(np.asarray(train.y), images) if spec.augment.mixes else train.y
    augmented = ArrayDataset(images, targets)
    return _nonempty(Datasets(train=augmented, eval=datasets.eval), plan)


def _cached(plan: Plan, paths: Sequence[str]) -> CachedRows | None:
    """Where ``paths`` lie in the plan's decoded cache (None: the plan has none)."""
    if plan.data.cache is None:
        return None
    return cached_rows(plan.data.cache, paths, "data.cache", plan.source)


def image_files(plan: Plan) -> list[str]:
    """Every image file an image plan reads: its training files and its held-out ones."""
    assert plan.data.path is not None
    paths = list(read_image_index(plan.data.path, "data.path", plan.source).paths)
    if plan.data.eval_path is not None:
        paths += read_image_index(plan.data.eval_path, "data.eval_path", plan.source).paths
    return paths


def _check_image_model(plan: Plan) -> None:
    """Images come as [h, w, 3] float rows: the model's input must be that."""
    assert plan.data.image_size is not None
    needed = (*plan.data.image_size, 3)
    _check_float_input(
        plan,
        needed,
        f"images of data.image_size {list(plan.data.image_size)} are rows {list(needed)}",
        "images are float inputs: model.input_dtype must be 'float32'",
    )


def image_classes(plan: Plan) -> tuple[str, ...]:
    """The class names of an image plan's training files, label i the i-th."""
    assert plan.data.path is not None
    return read_image_index(plan.data.path, "data.path", plan.source).classes


def _check_token_model(plan: Plan, tokens: np.ndarray, length: int) -> None:
    field = "data.path" if plan.data.source in ("tokens", "text") else "data.source"
    if plan.model.input_shape != (length,):
        raise PlanError(
            f"windows of {length} tokens do not fit model.input_shape {list(plan.model.input_shape)}",
            field="data.sequence_length",
            source=plan.source,
        )
    if plan.model.input_dtype != "int32":
        raise PlanError(
            "token data needs model.input_dtype = 'int32'", field="model.input_dtype", source=plan.source
        )
    shape = output_shape(plan)
    largest = int(tokens.max(initial=0))
    if shape is not None and largest >= shape[-1]:
        raise PlanError(
            f"token ids reach {largest} but the model's last layer has {shape[-1]} classes",
            field=field,
            source=plan.source,
        )


def _load_arrays(spec: DataSpec, path: str | None, source: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The training arrays: the digits, or ``x_key``/``y_key`` of the npz at ``path``."""
    if spec.source == "digits":
        return load_digits_arrays()
    return _read_npz(path, (spec.x_key, spec.y_key), ("data.x_key", "data.y_key"), "data.path", source)


def _read_npz(
    path: str | None, keys: tuple[str, str], key_fields: tuple[str, str], field: str, source: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """Arrays ``keys`` (x, y) of an .npz file; a missing one is named with its field, the
    file, the array nearest to it and the arrays the file has."""
    assert path is not None  # DataSpec refuses source "npz" without a path
    if not Path(path).is_file():
        raise PlanError(f"no such file {path}", field=field, source=source)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            for key, key_field in zip(keys, key_fields, strict=True):
                if key not in arrays.files:
                    near = closest_name(key, arrays.files)
                    hint = f"; did you mean {near!r}?" if near else ""
                    raise PlanError(
                        f"{path} has no array {key!r}{hint} (it has {', '.join(arrays.files)})",
                        field=key_field,
                        source=source,
                    )
            return np.asarray(arrays[keys[0]]), np.asarray(arrays[keys[1]])
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        # a truncated or corrupt file: one line naming it, not numpy's traceback
        raise PlanError(f"cannot read {path}: {error}", field=field, source=source) from None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 handwritten digits (real data shipped inside the package),
    scaled to [0, 1]: float32 rows of 64 pixels and int64 labels.

    Read from the package's own ``datasets/data/digits.csv.gz`` rather than through
    ``sklearn.datasets.load_digits``, whose import pulls in most of scikit-learn and SciPy
    (over a second of CPU in every process of every run); the values are the same
    (``tests/core/data/test_batches.py`` checks it)."""
    package = importlib.util.find_spec("sklearn")
    if package is None or package.origin is None:
        raise InputError("data.source = 'digits' needs scikit-learn: pip install scikit-learn")
    table = np.loadtxt(Path(package.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    pixels, labels = table[:, :-1], table[:, -1]
    return (pixels / 16.0).astype(np.float32), labels.astype(np.int64)


def _split(full: ArrayDataset, eval_fraction: float, seed: int) -> Datasets:
    if eval_fraction == 0.0:
        return Datasets(train=full, eval=None)
    order = np.random.default_rng([seed, 0xE7A1]).permutation(len(full))
    eval_rows = max(1, round(len(full) * eval_fraction))
    return Datasets(train=full.take(np.sort(order[eval_rows:])), eval=full.take(np.sort(order[:eval_rows])))
