"""The CLI and Python API around the torch backend, as a newcomer would use them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import crosstrain
from crosstrain import cli
from crosstrain.core.run.checkpoint import load_checkpoint
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import write_tokens
from crosstrain.testing.plans import GPT_PLAN
from tests.conftest import EXAMPLES, run_cli, worker_env
from tests.support import step_losses, summary

pytestmark = pytest.mark.torch


def test_backends_lists_torch_with_its_distribution_and_devices() -> None:
    result = run_cli("backends")
    assert result.returncode == 0, result.stderr
    torch_row = next(line for line in result.stdout.splitlines() if " torch " in line)
    assert "crosstrain" in torch_row and "2." in torch_row and "cpu" in torch_row


def test_unknown_backend_lists_the_registered_ones(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    result = run_cli("run", str(write_plan()), "--backend", "nosuch", "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert "unknown backend 'nosuch'; registered backends:" in result.stderr
    assert "torch" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_a_layout_the_backend_refuses_writes_nothing(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    result = run_cli("run", str(write_plan()), "--nproc", "2", "--workers", "1", "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert "one process per replica: --workers (1) must equal --nproc (2)" in result.stderr
    assert not (tmp_path / "o").exists()


def test_missing_framework_names_the_extra(write_plan: Callable[..., Path]) -> None:
    result = run_cli("-p", "tests.ghost_backend", "run", str(write_plan()), "--backend", "ghost")
    assert result.returncode == 2
    assert "pip install 'crosstrain[ghost]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_fit_from_python_returns_the_summary(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    result = crosstrain.fit(
        write_plan(),
        backend="torch",
        nproc=2,
        device="cpu",
        out=tmp_path / "run",
        overrides=["optimizer.lr=0.01", "train.max_steps=10"],
    )
    assert result["steps"] == 10 and result["world_size"] == 2
    assert summary(tmp_path / "run") == json.loads(json.dumps(result))
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["lr"] == 0.01


def test_checkpoint_holds_neutral_names_and_layouts(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    plan_path = write_plan()
    crosstrain.fit(
        plan_path,
        backend="torch",
        nproc=1,
        device="cpu",
        out=tmp_path / "run",
        overrides=["train.max_steps=1", "optimizer.lr=1e-9", "optimizer.momentum=0"],
    )
    saved = load_checkpoint(tmp_path / "run" / "model.safetensors")
    plan = load_plan(plan_path)
    initial = plan.model.graph().init_weights(plan.seed)
    assert set(saved) == set(initial)
    for name, value in initial.items():
        np.testing.assert_allclose(saved[name], value, atol=1e-6)  # one step at lr 1e-9


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(write_plan: Callable[..., Path], tmp_path: Path, precision: str) -> None:
    result = run_cli(
        "run",
        str(write_plan()),
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--out",
        str(tmp_path),
        "--set",
        f"train.precision='{precision}'",
        "--set",
        "train.epochs=2",
    )
    assert result.returncode == 0, result.stderr
    losses = step_losses(tmp_path)
    assert np.isfinite(losses).all() and losses[-5:].mean() < losses[:5].mean()
    assert summary(tmp_path)["precision"] == precision


def test_native_escape_hatch(tmp_path: Path) -> None:
    (tmp_path / "native_models.py").write_text(
        "import torch\n"
        "def build(plan):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))\n"
    )
    (tmp_path / "plan.py").write_text(
        "from crosstrain import Plan, ModelSpec, NativeModel, TrainSpec, OptimizerSpec\n"
        "plan = Plan(name='native', model=ModelSpec(input_shape=(64,), native=NativeModel(\n"
        "    torch='native_models:build')), optimizer=OptimizerSpec(name='adam', lr=0.003),\n"
        "    train=TrainSpec(global_batch_size=64, epochs=3))\n"
    )
    # native_models.py lies beside the plan, not on PYTHONPATH: the plan's folder is on the path
    result = run_cli(
        "run", str(tmp_path / "plan.py"), "--nproc", "2", "--device", "cpu", "--out", str(tmp_path / "run")
    )
    assert result.returncode == 0, result.stderr
    assert summary(tmp_path / "run")["eval"]["accuracy"] > 0.85
    assert "0.weight" in load_checkpoint(tmp_path / "run" / "model.safetensors")


def test_joins_an_existing_torchrun_group(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--max-restarts",
        "0",
        "-m",
        "crosstrain.cli",
        "run",
        str(write_plan()),
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "train.max_steps=10",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=worker_env())
    assert result.returncode == 0, result.stderr
    assert summary(tmp_path / "run")["world_size"] == 2
    assert len(step_losses(tmp_path / "run")) == 10  # rank 0 wrote once, not once per launcher


def test_cnn_python_plan_trains_cleanly_on_two_ranks_where_tensorflow_cannot_be_imported(
    tmp_path: Path,
) -> None:
    """torch's suite runs beside tf (one tox env); this run proves the torch backend needs
    none of it: packages named tensorflow and keras that refuse to import come first on the path."""
    blocked = tmp_path / "blocked"
    for name in ("tensorflow", "keras"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocked), env.get("PYTHONPATH", "")])
    result = run_cli(
        "run",
        str(EXAMPLES / "digits_cnn.py"),
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "train.epochs=5",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr  # e.g. DDP's gradient-layout warning on NHWC input
    assert summary(tmp_path / "run")["eval"]["accuracy"] > 0.9


def test_a_native_language_model_returns_per_position_logits(tmp_path: Path) -> None:
    """A native nn.Module on int token ids, [batch, length, vocabulary] logits: the loss and
    the token data path are the same as for a neutral model."""
    write_tokens(str(tmp_path / "tokens.npy"))
    (tmp_path / "native_lm.py").write_text(
        "import torch\n"
        "def build(plan):\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))\n"
    )
    (tmp_path / "plan.toml").write_text(
        GPT_PLAN.replace("layers = [", 'native = { torch = "native_lm:build" }\nlayers = [', 1)
    )
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = tmp_path / "run"
    arguments = ["run", str(tmp_path / "plan.toml"), "--nproc", "2", "--device", "cpu", "--out", str(out)]
    result = run_cli(*arguments, "--set", "train.max_steps=30", env=env)
    assert result.returncode == 0, result.stderr
    losses = step_losses(out)
    assert losses[-5:].mean() < losses[:5].mean()
    evaluation = summary(out)["eval"]
    assert evaluation["count"] == 25 * 16  # every position of the 25 eval windows (10 % of 249)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--nproc", "0"], "--nproc 0: the number of replicas must be at least 1"),
        (["--nproc", "-1"], "--nproc -1: the number of replicas must be at least 1"),
        (["--workers", "0"], "--workers 0: the number of processes must be at least 1"),
        (["--timeout", "0"], "--timeout 0: must be a positive number of seconds"),
        (["--max-restarts", "-1"], "--max-restarts -1: must be 0 or more"),
        (["--out", "FILE"], "--out FILE: is a file, not a folder"),
        (["--out", "FILE/run"], "--out FILE/run: cannot create the folder: Not a directory"),
    ],
)
def test_bad_numbers_and_output_folders_are_one_line_before_anything_starts(
    write_plan: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    message: str,
) -> None:
    file = tmp_path / "file"
    file.write_text("not a folder")
    arguments = [argument.replace("FILE", str(file)) for argument in arguments]
    code = cli.main(["run", str(write_plan()), "--device", "cpu", *arguments])
    assert code == 2
    assert capsys.readouterr().err == f"crosstrain: error: {message.replace('FILE', str(file))}\n"


def test_a_stale_torchrun_environment_does_not_override_nproc(
    write_plan: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    code = cli.main(["run", str(write_plan()), "--nproc", "2", "--out", str(tmp_path / "o")])
    assert code == 2
    error = capsys.readouterr().err
    assert error.startswith("crosstrain: error: --nproc 2, but the torchrun environment says WORLD_SIZE=1")
    assert not (tmp_path / "o").exists()


def test_bad_input_found_in_a_worker_exits_2_as_before_launch(tmp_path: Path) -> None:
    """A native factory that cannot be imported is found in the worker; it ends like any
    bad plan (exit 2, its line), as on the shared launcher's backends."""
    (tmp_path / "plan.py").write_text(
        "from crosstrain import Plan, ModelSpec, NativeModel, TrainSpec\n"
        "plan = Plan(name='native', model=ModelSpec(input_shape=(64,), native=NativeModel(\n"
        "    torch='nosuchmodule:build')), train=TrainSpec(global_batch_size=64, epochs=1))\n"
    )
    result = run_cli("run", str(tmp_path / "plan.py"), "--device", "cpu", "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.rstrip().splitlines() == [
        f"crosstrain: error: rank 0 failed: {tmp_path / 'plan.py'}: model.native.torch: "
        f"cannot load 'nosuchmodule:build': No module named 'nosuchmodule' "
        f"(traceback: {tmp_path / 'run' / 'error.log'})"
    ]


#: the classic Keras convnet as a Keras user writes it, scaled down: activation =, uint8
#: images scaled by 1/255, and the test arrays of the same .npz as the eval set
KERAS_CONVNET = """
name = "keras_convnet"
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 4, kernel_size = 3, activation = "relu" },
  { type = "maxpool2d", pool_size = 2 },
  { type = "flatten" },
  { type = "dense", units = 16, activation = "relu" },
  { type = "dense", units = 10 },
]
[data]
source = "npz"
path = "mnist.npz"
x_key = "x_train"
y_key = "y_train"
eval_x_key = "x_test"
eval_y_key = "y_test"
scale = 0.00392156862745098
[optimizer]
name = "adam"
lr = 0.003
[train]
global_batch_size = 20
epochs = 1
"""


def test_a_keras_users_first_plan_trains_and_a_missing_flatten_is_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "mnist.npz",
        x_train=rng.integers(0, 256, (60, 8, 8), dtype=np.uint8),
        y_train=rng.integers(0, 10, 60),
        x_test=rng.integers(0, 256, (30, 8, 8), dtype=np.uint8),
        y_test=rng.integers(0, 10, 30),
    )
    plan = tmp_path / "convnet.toml"
    plan.write_text(KERAS_CONVNET)
    result = run_cli("-p", "no:progress", "run", str(plan), "--device", "cpu", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path / "run")["eval"]["count"] == 30  # x_test, not a split of x_train
    plan.write_text(KERAS_CONVNET.replace('  { type = "flatten" },\n', ""))
    result = run_cli("run", str(plan), "--device", "cpu", "--out", str(tmp_path / "refused"))
    assert result.returncode == 2
    assert result.stderr == (
        f"crosstrain: error: {plan}: model.layers[2]: labels have shape [] per row but the model's "
        "logits need [3, 3]: this dense layer reads an image [3, 3, 4] and acts on its last axis "
        'only; add { type = "flatten" } before it\n'
    )
    assert not (tmp_path / "refused").exists()  # refused before anything started
