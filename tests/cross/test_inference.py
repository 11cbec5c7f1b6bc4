"""`crosstrain evaluate`, `predict` and `export` end to end: a run trained on torch,
evaluated and predicted on torch and tf, exported for torch and Keras and loaded back by a
fresh Python that cannot import crosstrain. The plan is written as a Keras user writes it
(``activation = "relu"``) and scales its inputs, which every one of them applies to raw rows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.admission.runfolder import read_run_plan
from crosstrain.core.data.scaling import ScaledRows
from crosstrain.core.errors import CheckpointError, InputError, RunFolderError
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.inference import evaluate_run, export_run, predict_run, read_rows
from crosstrain.testing.launches import made_once, shared_folder
from crosstrain.testing.plans import DROPOUT_MLP_PLAN, GPT_PLAN
from tests.conftest import run_cli
from tests.support import summary

pytestmark = pytest.mark.cross

#: torch and tf compute the same model within float32 rounding
PARITY = 1e-5
STEPS = 6
#: the dropout MLP with its activation written as Keras writes it: the same model
KERAS_STYLE_MLP = DROPOUT_MLP_PLAN.replace(
    '{ type = "dense", units = 128 },\n  { type = "relu" },',
    '{ type = "dense", units = 128, activation = "relu" },',
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dropout MLP on the digits, its inputs normalised, a few steps on torch, with
    periodic checkpoints; made once per session, by whichever pytest-xdist worker asks first."""

    def make(folder: Path) -> None:
        plan = folder / "mlp.toml"
        assert 'activation = "relu"' in KERAS_STYLE_MLP
        plan.write_text(KERAS_STYLE_MLP)
        result = run_cli(
            "-p", "no:progress", "run", str(plan), "--device", "cpu", "--out", str(folder / "run"),
            "--set", f"train.max_steps={STEPS}", "--set", "output.checkpoint_every_steps=3",
            "--set", "data.mean=0.3", "--set", "data.std=0.4",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        from sklearn.datasets import load_digits

        np.save(folder / "rows.npy", load_digits().data[:40])  # float64 [40, 64], as trained on

    return made_once(shared_folder(tmp_path_factory) / "inference", make) / "run"


def _evaluate(run: Path, *args: str) -> dict[str, float]:
    result = run_cli("evaluate", str(run), "--json", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout)["eval"])


def test_a_torch_run_evaluates_to_the_same_numbers_on_torch_and_tf(trained: Path) -> None:
    on_torch, on_tf = evaluate_run(trained)["eval"], _evaluate(trained, "--backend", "tf")
    assert on_torch == pytest.approx(summary(trained)["eval"], rel=1e-12)  # what training measured
    assert on_tf["count"] == on_torch["count"] == 359 and on_tf["accuracy"] == on_torch["accuracy"]
    assert on_tf["loss"] == pytest.approx(on_torch["loss"], rel=PARITY)


def test_evaluates_a_named_checkpoint(trained: Path) -> None:
    at_three = evaluate_run(trained, checkpoint="step-00000003")
    assert at_three["weights"].endswith("checkpoints/step-00000003/model.safetensors")
    assert evaluate_run(trained, checkpoint="3")["eval"] == at_three["eval"]
    assert at_three["eval"]["loss"] != evaluate_run(trained)["eval"]["loss"]  # other weights


def test_evaluates_raw_rows_and_labels_given_on_the_command_line(trained: Path) -> None:
    """The plan's own eval rows, raw (before data.mean/std), as files: the same numbers as
    the plan's eval set, so the rows were scaled as training scales them."""
    evaluation = load_datasets(read_run_plan(trained)).eval
    assert evaluation is not None and isinstance(evaluation.x, ScaledRows)
    rows, labels = trained.parent / "eval_x.npy", trained.parent / "eval_y.npy"
    np.save(rows, evaluation.x.raw[np.arange(len(evaluation))])
    np.save(labels, evaluation.y)
    given = _evaluate(trained, "--data", str(rows), "--labels", str(labels))
    assert given == evaluate_run(trained)["eval"]


def test_predicts_the_same_logits_on_torch_and_tf(trained: Path) -> None:
    rows, out = trained.parent / "rows.npy", trained.parent / "torch.npy"
    result = run_cli("predict", str(trained), "--data", str(rows), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    on_torch = np.load(out)
    assert on_torch.shape == (40, 10) and on_torch.dtype == np.float32
    on_tf = predict_run(trained, rows, trained.parent / "tf.npy", backend="tf")
    assert np.max(np.abs(on_tf - on_torch)) <= PARITY


_LOAD_WITHOUT_CROSSTRAIN = """
import sys
sys.modules["crosstrain"] = None  # any import of crosstrain now fails
import numpy as np, torch, keras
x = np.load(sys.argv[1]).astype(np.float32)
program = torch.export.load(sys.argv[2]).module()
state = torch.load(sys.argv[3])
model = keras.saving.load_model(sys.argv[4])
np.save(sys.argv[5], program(torch.from_numpy(x)).detach().numpy())
np.save(sys.argv[6], np.asarray(model.predict(x, verbose=0)))
print(sorted(state)[0])
"""


def test_exports_load_without_crosstrain_and_agree_with_predict(trained: Path) -> None:
    folder = trained.parent
    torch_files = export_run(trained, "torch", folder / "export-torch")  # the CLI's own call
    assert [path.name for path in torch_files] == ["model.pt2", "state_dict.pt"]
    result = run_cli("export", str(trained), "--format", "keras", "--out", str(folder / "export-keras"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in (folder / "export-keras").iterdir()) == ["model.keras"]
    rows = folder / "rows.npy"
    predicted = predict_run(trained, rows, folder / "reference.npy")
    loaded = subprocess.run(
        [
            sys.executable, "-c", _LOAD_WITHOUT_CROSSTRAIN, str(rows),
            str(folder / "export-torch" / "model.pt2"), str(folder / "export-torch" / "state_dict.pt"),
            str(folder / "export-keras" / "model.keras"), str(folder / "t.npy"), str(folder / "k.npy"),
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip() == "nodes.dense_0.linear.bias"  # torch's own names
    assert np.max(np.abs(np.load(folder / "t.npy") - predicted)) <= 1e-5
    assert np.max(np.abs(np.load(folder / "k.npy") - predicted)) <= 1e-5


def test_bad_input_is_one_line_naming_the_flag_or_file(trained: Path, tmp_path: Path) -> None:
    rows = trained.parent / "rows.npy"
    np.save(tmp_path / "narrow.npy", np.zeros((3, 7), np.float32))
    np.save(tmp_path / "text.npy", np.array([["a"] * 64]))
    (tmp_path / "notes.txt").write_text("not an array")
    narrow = ("predict", str(trained), "--data", str(tmp_path / "narrow.npy"), "--out", "o.npy")
    np.save(tmp_path / "three.npy", np.zeros(3, np.int64))
    labels = ("evaluate", str(trained), "--data", str(rows), "--labels", str(tmp_path / "three.npy"))
    cases = [
        (labels, f"--labels {tmp_path / 'three.npy'}: 3 rows, but --data {rows} has 40"),
        (("export", str(trained), "--format", "onnx"), "--format onnx: unknown format (known: keras, torch)"),
        (narrow, "narrow.npy: rows have shape [7] (array [3, 7]), model.input_shape is [64]"),
    ]
    for args, expected in cases:  # through the CLI: exit 2, one line
        result = run_cli(*args, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
        assert expected in result.stderr, result.stderr
    plan = read_run_plan(trained)  # the rest in-process: each names its flag or file
    (tmp_path / "gpt.toml").write_text(GPT_PLAN)
    gpt = load_plan(tmp_path / "gpt.toml")
    np.save(tmp_path / "ids.npy", np.full((2, 16), 32))
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    (damaged / "model.safetensors").write_bytes((trained / "model.safetensors").read_bytes()[:-100])
    refused: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (InputError, "--backend nosuch: unknown backend 'nosuch'", lambda: evaluate_run(trained, "nosuch")),
        (
            InputError,
            f"{tmp_path / 'nowhere'}: no such run folder",
            lambda: evaluate_run(tmp_path / "nowhere"),
        ),
        (InputError, "--checkpoint 4: no complete checkpoint", lambda: evaluate_run(trained, checkpoint="4")),
        (
            InputError,
            "text.npy: dtype <U1 is not a number type",
            lambda: read_rows(tmp_path / "text.npy", plan),
        ),
        (InputError, "notes.txt: not a .npy file", lambda: read_rows(tmp_path / "notes.txt", plan)),
        (
            InputError,
            "to 32, but model.layers[0] has vocab_size 32",
            lambda: read_rows(tmp_path / "ids.npy", gpt),
        ),
        (
            InputError,
            "missing does not exist",
            lambda: predict_run(trained, rows, tmp_path / "missing" / "o.npy"),
        ),
        (RunFolderError, "plan.json: no such file", lambda: evaluate_run(tmp_path)),
        (
            CheckpointError,
            f"{damaged / 'model.safetensors'}: cannot be read as safetensors",
            lambda: evaluate_run(damaged),
        ),
        (
            InputError,
            "already exists and is not an empty folder",
            lambda: export_run(trained, "torch", trained),
        ),
    ]
    for error, expected, call in refused:
        with pytest.raises(error, match=re.escape(expected)):
            call()
