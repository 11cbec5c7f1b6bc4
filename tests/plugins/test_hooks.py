"""Lifecycle hooks: their order and arguments, and the exception hook once with the failing
rank. In pytest's process on the null backend (one process holding 2 replicas), and the
exception hook over real 2-process worlds once per launcher: torch's elastic agent, and
crosstrain's own (tf --workers 2)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import InProcessCli, run_cli, worker_env

BACKENDS = [
    pytest.param(
        "torch",
        marks=[
            pytest.mark.torch,
            pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
        ],
    ),
    pytest.param(
        "tf",
        marks=[
            pytest.mark.tf,
            pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow"),
        ],
    ),
]


def _records(folder: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(folder.glob("rank*.jsonl"))
    }


def _arguments(plan: Path, out: Path, backend: str, *plugins: str, workers: int = 0) -> list[str]:
    layout = ["--nproc", "2", "--device", "cpu"] + (["--workers", str(workers)] if workers else [])
    overrides = ["--set", "train.epochs=2", "--set", "train.max_steps=8"]
    run = ["run", str(plan), "--backend", backend, *layout, "--out", str(out), *overrides]
    return ["-p", "tests.recording_plugin", *plugins, *run]


def _run(plan: Path, out: Path, backend: str, record_dir: Path, *plugins: str, workers: int = 0) -> Any:
    env = worker_env()
    env["CROSSTRAIN_TEST_RECORD_DIR"] = str(record_dir)
    return run_cli(*_arguments(plan, out, backend, *plugins, workers=workers), env=env)


NULL = ("-p", "crosstrain.testing.null")


def test_hook_order_and_arguments(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    backend = "null"
    arguments = _arguments(write_plan(), tmp_path / "run", backend)
    result = cli_in_process(*NULL, *arguments, env={"CROSSTRAIN_TEST_RECORD_DIR": str(tmp_path / "calls")})
    assert result.returncode == 0, result.stderr
    records = _records(tmp_path / "calls")
    # one process holding both replicas calls every hook (torch's processes, one per replica,
    # each call them too: every hook runs on every process, whatever the backend)
    assert records, "no hook was called"
    for calls in records.values():
        hooks = [call["hook"] for call in calls]
        # max_steps=8 ends training inside epoch 0 (45 steps long), so one evaluation follows
        assert hooks == (
            ["train_start"] + ["step_end"] * 8 + ["eval_end", "epoch_end", "checkpoint_saved", "train_end"]
        )
        assert [call["step"] for call in calls if call["hook"] == "step_end"] == list(range(1, 9))
        assert all(call["replicas"] == 2 and call["backend"] == backend for call in calls)
        assert calls[0]["total_steps"] == 8
        evaluation = next(call for call in calls if call["hook"] == "eval_end")
        assert evaluation["step"] == 8 and evaluation["metrics"]["count"] == 359  # 20% of 1,797
        saved = next(call for call in calls if call["hook"] == "checkpoint_saved")
        assert Path(saved["path"]).is_file()
    main = [calls for calls in records.values() if calls[0]["is_main"]]
    assert len(main) == 1
    losses = [[call["loss"] for call in calls if call["hook"] == "step_end"] for calls in records.values()]
    # metrics are global: one all-reduced value per step, the same bits on every rank
    assert all(other == losses[0] for other in losses)
    assert losses[0] == [float(step) for step in range(1, 9)]  # the null backend's: each step's number


def test_exception_hook_runs_once_with_the_failing_rank(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """In one process: the loop reports the failure and the worker around it re-raises it;
    the hook still runs once, and the CLI names the rank."""
    env = {"CROSSTRAIN_TEST_RECORD_DIR": str(tmp_path / "calls"), "CROSSTRAIN_TEST_FAIL_RANK": "0"}
    arguments = _arguments(write_plan(), tmp_path / "run", "null", "-p", "crosstrain.testing.faults")
    result = cli_in_process(*NULL, *arguments, env=env)
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith(
        "crosstrain: error: rank 0 failed: RuntimeError: injected failure at step 3"
    )
    calls = [call for rank_calls in _records(tmp_path / "calls").values() for call in rank_calls]
    exceptions = [call for call in calls if call["hook"] == "exception"]
    assert len(exceptions) == 1 and "injected failure at step 3" in exceptions[0]["error"]
    assert exceptions[0]["error_rank"] == exceptions[0]["rank"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_exception_hook_runs_once_with_the_failing_rank_of_two_processes(
    write_plan: Callable[..., Path], tmp_path: Path, backend: str
) -> None:
    """Once per launcher: torch's elastic agent, crosstrain's own (tf --workers 2)."""
    # two processes on every backend (tf: MultiWorkerMirrored), so that rank 1 exists to fail
    result = _run(
        write_plan(),
        tmp_path / "run",
        backend,
        tmp_path / "calls",
        "-p",
        "crosstrain.testing.faults",
        workers=2,
    )
    assert result.returncode != 0
    calls = [call for rank_calls in _records(tmp_path / "calls").values() for call in rank_calls]
    exceptions = [call for call in calls if call["hook"] == "exception"]
    injected = [call for call in exceptions if "injected failure at step 3" in call["error"]]
    assert len(injected) == 1 and injected[0]["error_rank"] == injected[0]["rank"] == 1
    # a peer may also see its collective break before the launcher stops it: at most once each
    assert len({call["rank"] for call in exceptions}) == len(exceptions)


def test_a_resumed_run_keeps_metric_lines_through_its_checkpoint(tmp_path: Path) -> None:
    from crosstrain.plugins.metrics import keep_through

    path = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 1.0}, {"step": 2, "eval": {}}, {"step": 3, "loss": 0.5}]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    keep_through(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
