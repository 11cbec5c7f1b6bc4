"""The table and text sources end to end through the CLI: a table of text and numbers trains
the same on torch and tf and a later table is evaluated by the run's kept statistics; a bad
table is refused before anything starts; the BPE GPT example trains the same on both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet
import pytest

from crosstrain.testing.launches import RunCache, train, train_refused, write_plan
from tests.conftest import EXAMPLES, run_cli
from tests.support import step_losses

pytestmark = pytest.mark.cross

#: per-step losses of torch and tf (absolute)
PARITY = 1e-4


def _evaluate(run: Path, *data: str) -> dict[str, float]:
    result = run_cli("evaluate", str(run), "--backend", "tf", "--json", "--data", *data)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout)["eval"])


def _coded_by_hand(table: Path, statistics: dict[str, list], features: list[str]) -> np.ndarray:
    """The table's features as the run's statistics code them: numbers as they are, each
    category its index in the kept code table."""
    columns = pyarrow.parquet.read_table(table).to_pydict()
    categories = statistics["categories"]
    coded = [
        [categories[name].index(value) for value in columns[name]] if name in categories else columns[name]
        for name in features
    ]
    return np.array(coded, np.float64).T


def test_a_table_trains_the_same_on_torch_and_tf_and_evaluates_a_later_table_as_trained(
    runs: RunCache, tmp_path: Path
) -> None:
    reference, mine = runs("torch", "table", 1), runs("tf", "table", 1)
    torch_losses, tf_losses = step_losses(reference), step_losses(mine)
    assert len(torch_losses) == 12
    assert np.max(np.abs(tf_losses - torch_losses)) <= PARITY
    kept = json.loads((reference / "statistics.json").read_text())
    assert kept == json.loads((mine / "statistics.json").read_text())
    assert kept["categories"]["plan"] == ["basic", "premium", "pro"]
    assert kept["label_classes"] == ["no", "yes"]
    # a later table without "basic" customers: coded by its own rows "pro" would be 1, not 2
    later = reference.parent / "churn_2026.parquet"
    features = kept["features"]
    labels = pyarrow.parquet.read_table(later).column("churned").to_pylist()
    np.save(tmp_path / "x.npy", _coded_by_hand(later, kept, features))
    np.save(tmp_path / "y.npy", np.array([kept["label_classes"].index(label) for label in labels]))
    by_table = _evaluate(reference, str(later))
    by_hand = _evaluate(reference, str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"))
    assert by_table == by_hand and by_table["count"] == 200


_EXPORTED_TORCH = """
import sys
sys.modules["crosstrain"] = None  # the exported program runs without crosstrain
import numpy as np, torch
program = torch.export.load(sys.argv[1]).module()
np.save(sys.argv[3], program(torch.from_numpy(np.load(sys.argv[2]).astype(np.float32))).detach().numpy())
"""


def test_a_standardised_table_run_exports_with_its_kept_statistics(runs: RunCache, tmp_path: Path) -> None:
    """The exported model applies statistics.json's mean and std itself: on the coded raw
    features of a later table it gives what crosstrain predict gives on the table."""
    run = runs("torch", "table", 1)
    kept = json.loads((run / "statistics.json").read_text())
    for format_name in ("torch", "keras"):
        exported = run_cli("export", str(run), "--format", format_name, "--out", str(tmp_path / format_name))
        assert exported.returncode == 0, exported.stderr[-3000:]
    later = run.parent / "churn_2026.parquet"
    predicted = run_cli("predict", str(run), "--data", str(later), "--out", str(tmp_path / "predicted.npy"))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    np.save(tmp_path / "coded.npy", _coded_by_hand(later, kept, kept["features"]))
    loaded = subprocess.run(
        [sys.executable, "-c", _EXPORTED_TORCH, str(tmp_path / "torch" / "model.pt2"),
         str(tmp_path / "coded.npy"), str(tmp_path / "exported.npy")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    reference = np.load(tmp_path / "predicted.npy")
    assert reference.shape == (200, 2)
    assert np.max(np.abs(np.load(tmp_path / "exported.npy") - reference)) <= 1e-5


def test_a_bad_table_is_refused_before_anything_starts(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, "table")
    line = train_refused(
        "torch", plan, tmp_path / "run", "data.features=['age', 'plan', 'monthly', 'city', 'tenur']"
    )
    assert line.endswith("churn.csv: has no column 'tenur'; did you mean 'tenure'?"), line


#: the BPE example, small: a quarter of its width, one block, windows of 32 tokens
TINY_GPT = (
    "model.width=0.25",
    "model.layers[3].repeat=1",
    "model.input_shape=[32]",
    "data.sequence_length=32",
    "data.limit=64",
    "train.global_batch_size=8",
)


def test_the_bpe_gpt_example_trains_the_same_on_torch_and_tf(tmp_path: Path) -> None:
    settings = [item for setting in TINY_GPT for item in ("--set", setting)]
    plan = EXAMPLES / "stdlib_gpt_bpe.toml"
    runs = [train(backend, plan, tmp_path / backend, 1, *settings, steps=4) for backend in ("torch", "tf")]
    losses = [step_losses(run) for run in runs]
    assert len(losses[0]) == 4 and losses[0][0] > 7.0  # about ln(4096): 4,096 classes
    assert np.max(np.abs(losses[1] - losses[0])) <= PARITY


def test_window_offsets_are_the_same_on_torch_and_tf_at_any_world_size(runs: RunCache) -> None:
    moved = "data.augment.window_offset=true"
    one, two, mine = (
        runs("torch", "gpt2_small", 1, moved),
        runs("torch", "gpt2_small", 2, moved),
        runs("tf", "gpt2_small", 2, moved),
    )
    assert np.max(np.abs(step_losses(two) - step_losses(one))) <= PARITY
    assert np.max(np.abs(step_losses(mine) - step_losses(two))) <= PARITY
    # the windows did move: the same plan without offsets (the torch suite's run) differs
    assert np.max(np.abs(step_losses(two) - step_losses(runs("torch", "gpt2_small", 2)))) > 1e-3
