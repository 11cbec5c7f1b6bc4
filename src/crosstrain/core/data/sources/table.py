"""``[data] source = "table"``: rows of a .csv or .parquet file, read with pyarrow.

Each of ``data.features`` is one input column, in the order given (``model.input_shape``
is ``[len(features)]``); ``data.label`` is the target. A numeric feature is read as
float32. A feature named in ``data.categorical`` is coded as one number: its values, as
text, sorted, numbered 0..n-1 (an ordinal code, not one-hot, so every feature stays one
input column and ``input_shape`` does not depend on the data; a model that should not see
an order embeds or one-hots the code itself). A label is a class id for ``cross_entropy``
(integers as they are; text classes coded as features are), a number otherwise.

The code tables are made from every row of ``data.path``; the mean and std of each numeric
feature (``data.standardize``) from the training rows only. Both are the table's
*statistics*: written once to the run folder (:data:`STATISTICS_FILE`) when the run starts
and read back, unchanged, by every worker, by a resumed run and by ``crosstrain
evaluate``/``predict`` on other tables, so a model always sees its inputs coded and scaled
as it was trained.

Nothing is imputed: a missing value (empty, null or NaN), text in a numeric column, a
category the statistics do not know, a missing column or an unreadable file is refused in
one line naming the file, the column and the first bad row (rows count from 1, the header
not counted), before any process starts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import numpy as np

from crosstrain.core.data.scaling import InputScaling
from crosstrain.core.errors import InputError, PlanError, did_you_mean

#: the statistics a table run keeps in its folder
STATISTICS_FILE = "statistics.json"
#: the file kinds the table source reads, by suffix
TABLE_FORMATS = {".csv": "CSV", ".parquet": "Parquet"}
#: what a user without pyarrow is told
INSTALL_HINT = "pip install 'crosstrain[table]'"


@attrs.frozen
class TableStatistics:
    """What a table run fixes when it starts: per feature the mean and std its values are
    standardised by (0 and 1 for categorical features, which are never scaled), the code
    table of each categorical feature, and the label's classes (None: numeric labels)."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    categories: dict[str, tuple[str, ...]]
    label_classes: tuple[str, ...] | None
    train_rows: int

    def scaling(self) -> InputScaling:
        return InputScaling(1.0, self.mean, self.std)

    def to_json(self) -> dict[str, Any]:
        return {
            "features": list(self.features),
            "mean": list(self.mean),
            "std": list(self.std),
            "categories": {name: list(codes) for name, codes in self.categories.items()},
            "label_classes": None if self.label_classes is None else list(self.label_classes),
            "train_rows": self.train_rows,
        }

    @classmethod
    def from_json(cls, document: Any) -> TableStatistics:
        classes = document["label_classes"]
        return cls(
            features=tuple(document["features"]),
            mean=tuple(float(value) for value in document["mean"]),
            std=tuple(float(value) for value in document["std"]),
            categories={name: tuple(codes) for name, codes in document["categories"].items()},
            label_classes=None if classes is None else tuple(classes),
            train_rows=int(document["train_rows"]),
        )


def write_statistics(folder: Path, statistics: TableStatistics) -> Path:
    """The statistics as JSON in ``folder``, replaced atomically."""
    path = Path(folder) / STATISTICS_FILE
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(statistics.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return path


def read_statistics(folder: str | Path | None) -> TableStatistics | None:
    """The statistics a run folder keeps; None where it keeps none (a new run)."""
    if folder is None:
        return None
    path = Path(folder) / STATISTICS_FILE
    if not path.is_file():
        return None
    try:
        return TableStatistics.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"{path}: not a crosstrain statistics file ({error})") from None


@attrs.frozen
class Columns:
    """Where a table's problems are reported: its file, the plan field naming it, the plan."""

    path: str
    field: str
    source: str | None

    def refuse(self, message: str) -> PlanError:
        return PlanError(f"{self.path}: {message}", field=self.field, source=self.source)


def _pyarrow() -> tuple[ModuleType, ModuleType]:
    """pyarrow and pyarrow.compute, imported only when a plan reads a table."""
    try:
        import pyarrow
        import pyarrow.compute
    except ImportError:
        raise InputError(
            f"data.source 'table' reads .csv and .parquet files with pyarrow: {INSTALL_HINT}"
        ) from None
    return pyarrow, pyarrow.compute


def read_table(path: str, columns: Sequence[str], where: Columns, categorical: Sequence[str] = ()) -> Any:
    """The ``columns`` of the table at ``path`` (a pyarrow Table, in that order); a file of
    another kind, a missing or unreadable file or a missing column is refused."""
    pyarrow, _ = _pyarrow()
    suffix = Path(path).suffix.lower()
    if suffix not in TABLE_FORMATS:
        raise where.refuse(f"not a table file: the table source reads {', '.join(TABLE_FORMATS)} files")
    if not Path(path).is_file():
        raise where.refuse("no such file")
    try:
        names = _column_names(path, suffix)
        _check_columns(columns, names, where)
        return _read_columns(path, suffix, list(dict.fromkeys(columns)), categorical)
    except (OSError, ValueError, pyarrow.ArrowException) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise where.refuse(f"cannot read it as {TABLE_FORMATS[suffix]}: {first_line}") from None


def _column_names(path: str, suffix: str) -> list[str]:
    if suffix == ".parquet":
        import pyarrow.parquet

        return list(pyarrow.parquet.read_schema(path).names)
    import pyarrow.csv

    with pyarrow.csv.open_csv(path) as reader:
        return list(reader.schema.names)


def _check_columns(wanted: Sequence[str], names: Sequence[str], where: Columns) -> None:
    for name in wanted:
        if name not in names:
            raise where.refuse(f"has no column {name!r}{did_you_mean(name, names)}")


def _read_columns(path: str, suffix: str, columns: list[str], categorical: Sequence[str]) -> Any:
    if suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path, columns=columns)
    import pyarrow
    import pyarrow.csv

    # categories stay text ("007" is not 7); an empty field is a missing value, refused later
    options = pyarrow.csv.ConvertOptions(
        include_columns=columns,
        strings_can_be_null=True,
        column_types={name: pyarrow.string() for name in categorical},
    )
    return pyarrow.csv.read_csv(path, convert_options=options)


# --------------------------------------------------------------------------- columns


def _first_missing(column: Any, compute: ModuleType) -> int | None:
    """The index of the column's first null (or NaN) value; None when it has none."""
    missing = np.asarray(compute.is_null(column, nan_is_null=True).to_numpy(zero_copy_only=False))
    found = np.flatnonzero(missing)
    return int(found[0]) if len(found) else None


def _refuse_missing(column: Any, name: str, where: Columns, compute: ModuleType) -> None:
    row = _first_missing(column, compute)
    if row is not None:
        raise where.refuse(
            f"column {name!r} row {row + 1}: a missing value (empty, null or NaN); crosstrain does "
            "not fill values in: fill or drop the row"
        )


def numeric_column(column: Any, name: str, where: Columns) -> np.ndarray:
    """A numeric column as float64 (booleans 0/1); text or a missing value is refused."""
    pyarrow, compute = _pyarrow()
    kind = column.type
    if pyarrow.types.is_null(kind):  # nothing but missing values
        _refuse_missing(column, name, where, compute)
    if not (
        pyarrow.types.is_integer(kind) or pyarrow.types.is_floating(kind) or pyarrow.types.is_boolean(kind)
    ):
        raise where.refuse(_not_numeric(column, name))
    _refuse_missing(column, name, where, compute)
    values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
    infinite = np.flatnonzero(~np.isfinite(values))
    if len(infinite):
        raise where.refuse(f"column {name!r} row {int(infinite[0]) + 1}: {values[infinite[0]]} is not finite")
    return values


def _not_numeric(column: Any, name: str) -> str:
    """The first value of a text column that is not a number, with the fix."""
    hint = "; list it in data.categorical to code its values as categories"
    for row, value in enumerate(column.to_pylist()):
        if value is None:
            continue
        try:
            float(value)
        except (TypeError, ValueError):
            return f"column {name!r} row {row + 1}: {value!r} is not a number{hint}"
    return f"column {name!r} holds {column.type} values, not numbers{hint}"


def text_values(column: Any, name: str, where: Columns) -> Any:
    """A categorical column as text (pyarrow strings); a missing value is refused."""
    pyarrow, compute = _pyarrow()
    _refuse_missing(column, name, where, compute)
    return compute.cast(column, pyarrow.string())


def code_table(column: Any) -> tuple[str, ...]:
    """A categorical column's values, sorted as text: value i is coded i."""
    _, compute = _pyarrow()
    return tuple(sorted(compute.unique(column).to_pylist()))


def coded(column: Any, codes: tuple[str, ...], name: str, where: Columns) -> np.ndarray:
    """Each value's position in ``codes``; a value not in it is refused."""
    pyarrow, compute = _pyarrow()
    found = compute.index_in(column, value_set=pyarrow.array(codes, pyarrow.string()))
    unknown = np.flatnonzero(np.asarray(compute.is_null(found).to_numpy(zero_copy_only=False)))
    if len(unknown):
        row = int(unknown[0])
        value = column[row].as_py()
        known = ", ".join(repr(code) for code in codes[:10]) + (", ..." if len(codes) > 10 else "")
        raise where.refuse(
            f"column {name!r} row {row + 1}: {value!r} is not a category the run was trained with "
            f"(it knows {known})"
        )
    return np.asarray(found.to_numpy(zero_copy_only=False), dtype=np.int64)


# --------------------------------------------------------------------------- the whole table


@attrs.frozen
class TableSpec:
    """What the plan says of a table: its columns, and whether the label is a class."""

    features: tuple[str, ...]
    label: str
    categorical: tuple[str, ...]
    classes: bool


def read_codes(
    table: Any, spec: TableSpec, where: Columns
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...] | None]:
    """The code tables of the categorical features and (for text classes) of the label."""
    pyarrow, _ = _pyarrow()
    categories = {name: code_table(text_values(table.column(name), name, where)) for name in spec.categorical}
    label = table.column(spec.label)
    label_classes = None
    # text classes: strings, or a dictionary column (pandas's categorical, as Parquet keeps it)
    text = any(
        check(label.type)
        for check in (pyarrow.types.is_string, pyarrow.types.is_large_string, pyarrow.types.is_dictionary)
    )
    if spec.classes and text:
        label_classes = code_table(text_values(label, spec.label, where))
    return categories, label_classes


def encode_features(
    table: Any, spec: TableSpec, categories: dict[str, tuple[str, ...]], where: Columns
) -> np.ndarray:
    """The feature columns as float32 rows ``[rows, features]``: numbers as they are,
    categories as their codes."""
    columns = []
    for name in spec.features:
        column = table.column(name)
        if name in spec.categorical:
            columns.append(coded(text_values(column, name, where), categories[name], name, where))
        else:
            columns.append(numeric_column(column, name, where))
    return (
        np.stack(columns, axis=1).astype(np.float32) if columns else np.zeros((table.num_rows, 0), np.float32)
    )


def encode_label(
    table: Any, spec: TableSpec, label_classes: tuple[str, ...] | None, where: Columns
) -> np.ndarray:
    """The label column: class ids (int64) for a classifier, else float32 targets."""
    column = table.column(spec.label)
    if label_classes is not None:
        return coded(text_values(column, spec.label, where), label_classes, spec.label, where)
    values = numeric_column(column, spec.label, where)
    if not spec.classes:
        return values.astype(np.float32)
    fractional = np.flatnonzero(np.mod(values, 1) != 0)
    if len(fractional):
        row = int(fractional[0])
        raise where.refuse(
            f"column {spec.label!r} row {row + 1}: {values[row]:g} is not a class (cross_entropy "
            "needs whole numbers or text labels)"
        )
    return values.astype(np.int64)


def compute_statistics(
    train_x: np.ndarray,
    spec: TableSpec,
    categories: dict[str, tuple[str, ...]],
    label_classes: tuple[str, ...] | None,
) -> TableStatistics:
    """Mean and std (population, as scikit-learn's StandardScaler) of each numeric feature
    over the training rows; a constant column keeps std 1 (it is only shifted)."""
    mean, std = [], []
    for index, name in enumerate(spec.features):
        if name in spec.categorical or len(train_x) == 0:
            mean.append(0.0)
            std.append(1.0)
            continue
        values = train_x[:, index].astype(np.float64)
        spread = float(values.std())
        mean.append(float(values.mean()))
        std.append(spread if spread > 0 and math.isfinite(spread) else 1.0)
    return TableStatistics(
        features=spec.features,
        mean=tuple(mean),
        std=tuple(std),
        categories=categories,
        label_classes=label_classes,
        train_rows=len(train_x),
    )


def check_statistics_fit(statistics: TableStatistics, spec: TableSpec, where: Columns) -> None:
    """Statistics kept by a run describe the plan's features (a run's plan cannot change
    them, but a hand-edited file can)."""
    if statistics.features != spec.features or set(statistics.categories) != set(spec.categorical):
        raise where.refuse(
            f"the run's {STATISTICS_FILE} describes features {list(statistics.features)} "
            f"(categorical {sorted(statistics.categories)}), not the plan's {list(spec.features)}"
        )
