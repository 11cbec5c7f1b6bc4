"""The trackers (--mlflow, --wandb) through the real CLI on the momentum backend, in pytest's
process: MLflow's store, read back through MLflow's own client, and W&B's offline run
folder hold every step and evaluation metrics.jsonl holds; a continued run logs into the
same tracker run; a tracker that fails warns once and the run loses nothing."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crosstrain.plugins.metrics import read_metrics
from crosstrain.tracking.base import TRACKERS_FILE
from tests.conftest import InProcessCli

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

NULL = ("-p", "crosstrain.testing.null", "-p", "no:progress")
SETTINGS = ("--set", "train.epochs=2", "--set", "output.log_every_steps=1")
SETTINGS += ("--set", "output.checkpoint_every_steps=20")


def histories(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) history as metrics.jsonl holds it, named as trackers log it."""
    found: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(run_dir):
        values = (
            {f"eval_{k}": v for k, v in record["eval"].items() if k != "count"}
            if "eval" in record
            else record
        )
        for name, value in values.items():
            if name not in ("step", "epoch", "eval"):
                found.setdefault(name, []).append((record["step"], value))
    return found


def test_mlflow_holds_what_metrics_jsonl_holds_and_a_continued_run_logs_into_the_same_run(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "runs" / "a"
    base = (*NULL, "run", str(write_plan()), "--backend", "momentum", "--out", str(out), *SETTINGS)
    env = {"MLFLOW_TRACKING_URI": None}
    assert cli_in_process(*base, "--mlflow", env=env).returncode == 0
    continued = ("--resume", "--set", "train.epochs=3")
    assert cli_in_process(*base, *continued, "--mlflow", env=env).returncode == 0
    run_id = json.loads((out / TRACKERS_FILE).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    expected = histories(out)
    assert {"loss", "lr", "eval_loss"} <= set(expected)
    assert len(expected["loss"]) == 3 * 45  # three epochs of 1,438 rows / 32, each step once
    for name, history in expected.items():
        logged = [(metric.step, metric.value) for metric in client.get_metric_history(run_id, name)]
        assert sorted(logged) == history, name
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.05" and run.data.params["backend"] == "momentum"
    speeds = client.get_metric_history(run_id, "samples_per_second")
    assert len(speeds) == 3 * 45 and all(metric.value > 0 for metric in speeds)
    artifacts = {item.path for item in client.list_artifacts(run_id)}
    assert {"plan.json", "summary.json", "model.safetensors", "curves.png"} <= artifacts


def wandb_history(run_dir: Path) -> Iterator[tuple[int, dict[str, float]]]:
    """The history records of the offline run's .wandb file: W&B's leveldb-style log of
    protobuf records (7-byte header; 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, record = path.read_bytes()[7:], 32768, b""
    offset = 0
    while offset + 7 <= len(data):
        room = block - (offset + 7) % block  # chunks never cross a block; the rest is padding
        if room < 7:
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if length == 0 and kind == 0:
            offset += block - (offset + 7) % block
            continue
        record += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            record = b""
            if parsed.WhichOneof("record_type") == "history":
                history = parsed.history
                yield (
                    history.step.num,
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in history.item
                    },
                )


def test_wandb_keeps_an_offline_run_with_the_same_history(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    out = tmp_path / "run"
    env = {
        name: str(tmp_path / "wandb-home")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
    }
    env |= {"WANDB_API_KEY": None, "WANDB_MODE": None, "HOME": str(tmp_path / "home")}  # no credentials
    arguments = (*NULL, "run", str(write_plan()), "--backend", "momentum", "--out", str(out), *SETTINGS)
    assert cli_in_process(*arguments, "--wandb", "crosstrain-tests", env=env).returncode == 0
    logged: dict[str, list[tuple[int, float]]] = {}
    for step, record in wandb_history(out):
        for name, value in record.items():
            if not name.startswith("_"):
                logged.setdefault(name, []).append((step, value))
    expected = histories(out)
    for name in ("loss", "lr", "eval_loss", "eval_accuracy"):
        assert logged[name] == expected[name], name


def test_a_tracker_that_fails_warns_once_and_the_run_loses_nothing(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    out = tmp_path / "run"
    plugins = ("-p", "tests.tracking.failing_tracker")
    arguments = (*NULL, *plugins, "run", str(write_plan()), "--backend", "momentum", "--out", str(out))
    settings = (*SETTINGS, "--set", "train.epochs=3")
    result = cli_in_process(*arguments, *settings, "--failing")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "crosstrain: warning: --failing failed to log metrics (OSError: [Errno 28] No space left on device); "
        "the run goes on without it (metrics.jsonl has every value)"
    ]
    calls = (out / "failing-tracker.log").read_text().splitlines()
    assert calls == ["open", "params", "metrics 1", "metrics 2", "close failed=True"]  # nothing after
    assert len(histories(out)["loss"]) == 3 * 45


def test_a_tracker_that_cannot_start_warns_once(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    out = tmp_path / "run"
    arguments = (*NULL, "run", str(write_plan()), "--backend", "momentum", "--out", str(out), *SETTINGS)
    (tmp_path / "not-a-folder").write_text("")
    result = cli_in_process(*arguments, "--mlflow", f"sqlite:///{tmp_path / 'not-a-folder' / 'mlflow.db'}")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("crosstrain: warning: --mlflow could not start (")
    assert len(histories(out)["loss"]) == 2 * 45


def test_a_tracker_without_its_package_is_refused_before_launch(
    write_plan: Callable[..., Path],
    tmp_path: Path,
    cli_in_process: InProcessCli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    out = tmp_path / "run"
    result = cli_in_process(
        *NULL, "run", str(write_plan()), "--backend", "momentum", "--out", str(out), "--mlflow"
    )
    assert result.returncode == 2
    assert "--mlflow: needs the mlflow package: pip install 'crosstrain[mlflow]'" in result.stderr
    assert not out.exists()
