"""The table and text sources: category codes and the statistics a run keeps, each bad
table refused in one line, and text tokenized exactly as the tokenizers package does,
once (no framework needed)."""

from __future__ import annotations

import csv
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from crosstrain.core.admission.runfolder import write_data_statistics
from crosstrain.core.data.sources import text
from crosstrain.core.data.sources.table import STATISTICS_FILE, read_statistics
from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.run.loading import epoch_rows, load_datasets, table_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import TABLE_PLAN, churn_columns, write_churn_tables, write_tokens
from crosstrain.testing.plans import GPT_PLAN
from tests.conftest import EXAMPLES

BPE = EXAMPLES / "tokenizers" / "stdlib_bpe_4096.json"


def _csv_column(path: Path, name: str) -> list[str]:
    with path.open(newline="", encoding="utf-8") as handle:
        return [row[name] for row in csv.DictReader(handle)]


def test_a_table_codes_its_categories_and_standardises_by_the_training_rows(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    write_churn_tables(str(tmp_path))
    plan = load_plan(write_plan(TABLE_PLAN), ["data.eval_fraction=0"])
    raw, statistics = table_datasets(plan)
    plans = _csv_column(tmp_path / "churn.csv", "plan")
    assert statistics.categories["plan"] == ("basic", "premium", "pro")  # sorted as text
    assert statistics.label_classes == ("no", "yes")
    x = np.asarray(raw.train.x)
    assert np.array_equal(x[:, 1], [statistics.categories["plan"].index(value) for value in plans])
    ages = np.array(_csv_column(tmp_path / "churn.csv", "age"), np.float64)
    assert statistics.mean[0] == pytest.approx(ages.mean()) and statistics.std[0] == pytest.approx(ages.std())
    assert (statistics.mean[1], statistics.std[1]) == (0.0, 1.0)  # a code is never scaled
    labels = _csv_column(tmp_path / "churn.csv", "churned")
    assert np.array_equal(raw.train.y, [("no", "yes").index(label) for label in labels])
    scaled = load_datasets(plan).train.x[np.arange(3)]
    assert np.allclose(scaled[:, 0], (ages[:3] - ages.mean()) / ages.std(), atol=1e-5)
    assert np.array_equal(scaled[:, 1], x[:3, 1])


def test_the_statistics_a_run_keeps_are_reused_as_they_are(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    write_churn_tables(str(tmp_path))
    plan = load_plan(write_plan(TABLE_PLAN))
    run = tmp_path / "run"
    run.mkdir()
    write_data_statistics(run, plan)
    kept = read_statistics(run)
    assert kept == table_datasets(plan)[1] and (run / STATISTICS_FILE).is_file()
    assert kept is not None and kept.train_rows == 480  # the mean and std of the training rows only
    # the table changes (no "basic" customers any more): a new run would code "pro" as 1;
    # the run's kept codes and mean stay
    import pyarrow
    import pyarrow.csv

    pyarrow.csv.write_csv(
        pyarrow.table(churn_columns(300, seed=5, plans=("pro", "premium"))), tmp_path / "churn.csv"
    )
    assert table_datasets(plan)[1].categories["plan"] == ("premium", "pro")
    datasets, statistics = table_datasets(plan, run)
    assert statistics == kept
    codes = np.asarray(datasets.train.x)[:, 1]
    assert set(codes.tolist()) == {1.0, 2.0}  # premium 1 and pro 2, as the run was trained


BAD_TABLES = {
    "missing column": (
        'age,plan\n1,"a"\n',
        "data.features=['agee', 'plan']",
        r"churn\.csv: has no column 'agee'; did you mean 'age'\?",
    ),
    "text in a number": (
        'age,plan\n1,"a"\nforty,"b"\n',
        "",
        r"churn\.csv: column 'age' row 2: 'forty' is not a number; list it in data\.categorical",
    ),
    "missing value": (
        'age,plan\n1,"a"\n2,"b"\n,"c"\n',
        "",
        r"churn\.csv: column 'age' row 3: a missing value \(empty, null or NaN\)",
    ),
    "NaN": ('age,plan\nNaN,"a"\n', "", r"column 'age' row 1: a missing value"),
    "missing category": ('age,plan\n1,"a"\n2,\n', "", r"column 'plan' row 2: a missing value"),
    "fraction as a class": (
        "age,plan,churned\n1,a,0.5\n",
        "data.label='churned'",
        r"column 'churned' row 1: 0\.5 is not a class",
    ),
    "input shape": (
        'age,plan\n1,"a"\n',
        "model.input_shape=[3]",
        r"model\.input_shape: \[3\], but data\.features names 2 columns",
    ),
}


def test_the_run_folder_keeps_the_statistics_the_admission_computed_without_a_second_read(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """The admission reads the table once (``load_datasets``); the run folder is written
    from what it computed (``Job.table_statistics``), not from a second read of the file."""
    write_churn_tables(str(tmp_path))
    plan = load_plan(write_plan(TABLE_PLAN))
    computed = load_datasets(plan).statistics
    assert computed is not None and computed == table_datasets(plan)[1]
    assert plan.data.path is not None
    Path(plan.data.path).unlink()  # a second read would fail
    run = tmp_path / "run"
    run.mkdir()
    write_data_statistics(run, plan, computed.to_json())
    assert read_statistics(run) == computed


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_a_bad_table_is_refused_in_one_line_naming_file_column_and_row(
    case: str, write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    content, setting, message = BAD_TABLES[case]
    (tmp_path / "churn.csv").write_text(content)
    plan_text = TABLE_PLAN.replace('["age", "plan", "monthly", "city", "tenure"]', '["age", "plan"]')
    plan_text = plan_text.replace('["plan", "city"]', '["plan"]').replace(
        "input_shape = [5]", "input_shape = [2]"
    )
    settings = [setting] if setting else []
    if "churned" not in content:
        settings.append("data.label='plan'")
    with pytest.raises(PlanError, match=message) as refused:
        load_datasets(load_plan(write_plan(plan_text), settings))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("churn.parquet", b"not parquet at all", r"churn\.parquet: cannot read it as Parquet: "),
        ("churn.xlsx", b"", r"churn\.xlsx: not a table file: the table source reads \.csv, \.parquet files"),
        ("churn.csv", None, r"churn\.csv: no such file"),
    ],
)
def test_an_unreadable_table_file_is_named(
    name: str, content: bytes | None, message: str, write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(PlanError, match=rf"data\.path: .*{message}"):
        load_datasets(load_plan(write_plan(TABLE_PLAN.replace("churn.csv", name))))


TEXT_PLAN = """
name = "text"
[model]
input_shape = [8]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 4096, units = 8 },
  { type = "dense", units = 4096 },
]
[data]
source = "text"
path = "corpus/*.txt"
tokenizer = "bpe.json"
sequence_length = 8
eval_fraction = 0.1
"""

CORPUS = {
    "b.txt": "def mean(values):\n    return sum(values) / len(values)\n",
    "a.txt": "# café, naïve, 数据\nclass Table:\n    pass\n" * 3,
    "c.md": "not matched by the glob",
}


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CROSSTRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus").mkdir()
    for name, content in CORPUS.items():
        (tmp_path / "corpus" / name).write_text(content, encoding="utf-8")
    shutil.copy(BPE, tmp_path / "bpe.json")
    return tmp_path


def test_text_is_tokenized_as_tokenizers_encodes_it_once_into_the_cache(
    corpus: Path, write_plan: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = load_plan(write_plan(TEXT_PLAN))
    data = load_datasets(plan)
    tokenizer = Tokenizer.from_file(str(BPE))
    expected = np.concatenate([tokenizer.encode(CORPUS[name]).ids for name in ("a.txt", "b.txt")])
    tokens = data.train.x.tokens  # type: ignore[attr-defined]
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert np.array_equal(tokens, expected)
    assert np.array_equal(data.train.x[np.array([1])][0], expected[8:16])
    assert np.array_equal(data.train.y[np.array([1])][0], expected[9:17])
    (cached,) = (corpus / "cache").glob("text-*.npy")
    # read again: the same cache file, never tokenized twice
    with monkeypatch.context() as patched:
        patched.setattr(text, "tokenize", lambda *arguments: pytest.fail("tokenized twice"))
        load_datasets(plan)
    assert list((corpus / "cache").glob("text-*.npy")) == [cached]
    # an edited file is another corpus: tokenized anew, beside the first
    (corpus / "corpus" / "b.txt").write_text("x = 1\n" * 40, encoding="utf-8")
    load_datasets(plan)
    assert len(list((corpus / "cache").glob("text-*.npy"))) == 2


def test_text_without_a_tokenizer_is_its_bytes(corpus: Path, write_plan: Callable[..., Path]) -> None:
    plan_text = TEXT_PLAN.replace('tokenizer = "bpe.json"\n', "").replace("4096", "256")
    data = load_datasets(load_plan(write_plan(plan_text)))
    expected = (CORPUS["a.txt"] + CORPUS["b.txt"]).encode()
    assert bytes(np.asarray(data.train.x.tokens)) == expected  # type: ignore[attr-defined]


def test_a_model_smaller_than_the_tokenizers_vocabulary_is_refused(
    corpus: Path, write_plan: Callable[..., Path]
) -> None:
    plan = load_plan(write_plan(TEXT_PLAN), ["model.layers[0].vocab_size=256"])
    with pytest.raises(PlanError, match=r"model\.layers\[0\]\.vocab_size: vocab_size 256 is smaller than"):
        load_datasets(plan)
    with pytest.raises(PlanError, match=r"data\.path: .*nothing\*\.txt holds no files"):
        load_datasets(load_plan(write_plan(TEXT_PLAN.replace("*.txt", "nothing*.txt"))))


def test_window_offsets_are_a_hash_of_seed_epoch_and_row(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    rows = np.arange(4000)
    offsets = text.window_offsets(7, 2, rows, 16)
    assert offsets.min() == 0 and offsets.max() == 15 and len(np.unique(offsets)) == 16
    # each row's draw is its own: any subset of rows (another replica's share) draws the same
    assert np.array_equal(text.window_offsets(7, 2, rows[[3999, 5, 17]], 16), offsets[[3999, 5, 17]])
    assert not np.array_equal(text.window_offsets(7, 3, rows, 16), offsets)  # anew every epoch
    assert not np.array_equal(text.window_offsets(8, 2, rows, 16), offsets)
    write_tokens(str(tmp_path / "tokens.npy"), count=1001)
    plan = load_plan(write_plan(GPT_PLAN), ["data.augment.window_offset=true"])
    train = load_datasets(plan).train
    assert len(train) == 55  # 62 windows of 16, 6 held out, the last training one left out
    moved = epoch_rows(train, plan, epoch=2)
    shifts = text.window_offsets(plan.seed, 2, np.arange(55), 16)
    tokens = np.load(tmp_path / "tokens.npy")
    for row in (0, 54):
        start = row * 16 + shifts[row]
        assert np.array_equal(moved.x[np.array([row])][0], tokens[start : start + 16])
        assert np.array_equal(moved.y[np.array([row])][0], tokens[start + 1 : start + 17])
    assert 54 * 16 + shifts[54] + 16 < 56 * 16  # no target read from the eval windows
    assert epoch_rows(train, load_plan(write_plan(GPT_PLAN)), epoch=2) is train


@pytest.mark.parametrize(
    ("module", "plan_text", "extra"),
    [("pyarrow", TABLE_PLAN, "table"), ("tokenizers", TEXT_PLAN, "text")],
)
def test_a_missing_package_names_its_extra(
    module: str,
    plan_text: str,
    extra: str,
    corpus: Path,
    write_plan: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    with pytest.raises(InputError, match=rf"pip install 'crosstrain\[{extra}\]'$"):
        load_datasets(load_plan(write_plan(plan_text)))
