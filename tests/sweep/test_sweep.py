"""crosstrain sweep on the momentum backend (crosstrain.testing.null): the sweep in pytest's
process, each trial a real `crosstrain run` process; the study in sqlite continues where it
stopped, and a trial a killed sweep left running is resumed from its checkpoint."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.spec.planfile import load_plan
from tests.conftest import InProcessCli, worker_env

optuna = pytest.importorskip("optuna")

NULL = ("-p", "crosstrain.testing.null")
LENGTH = ("--set", "train.epochs=3", "--set", "output.checkpoint_every_steps=40")


def sweep(
    cli: InProcessCli, plan: Path, out: Path, trials: int, *more: str
) -> subprocess.CompletedProcess[str]:
    return cli(
        *NULL, "sweep", str(plan), "--trials", str(trials), "--search", "optimizer.lr=log(0.001,0.5)",
        "--objective", "eval_loss", "--backend", "momentum", "--out", str(out), *LENGTH, *more,
    )  # fmt: skip


def study_of(out: Path) -> optuna.Study:
    return optuna.load_study(study_name="crosstrain", storage=f"sqlite:///{out / 'study.sqlite'}")


def test_a_sweep_runs_every_trial_as_a_run_and_the_same_command_continues_it(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    plan, out = write_plan(), tmp_path / "sweep"
    result = sweep(cli_in_process, plan, out, 6, "--parallel", "2")
    assert result.returncode == 0, result.stderr
    study = study_of(out)
    assert len(study.trials) == 6
    for trial in study.trials:
        assert trial.state.name in ("COMPLETE", "PRUNED")
        summary = json.loads((out / "trials" / str(trial.number) / "summary.json").read_text())
        lr = json.loads((out / "trials" / str(trial.number) / "plan.json").read_text())["plan"]["optimizer"][
            "lr"
        ]
        assert lr == trial.params["optimizer.lr"]
        if trial.state.name == "COMPLETE":
            assert summary["eval"]["loss"] == trial.value and summary["steps"] == 3 * 45
    complete = [trial.value for trial in study.trials if trial.value is not None]
    assert study.best_value <= statistics.median(complete)
    best = load_plan(out / "best.toml")
    assert best.optimizer.lr == study.best_params["optimizer.lr"] and best.train.epochs == 3
    assert (out / "sweep.png").stat().st_size > 0
    assert "best: trial" in result.stdout
    finished = {path: path.stat().st_mtime_ns for path in out.glob("trials/*/summary.json")}
    again = sweep(cli_in_process, plan, out, 8)
    assert again.returncode == 0, again.stderr
    assert len(study_of(out).trials) == 8 and sorted(p.name for p in (out / "trials").iterdir()) == [
        str(number) for number in range(8)
    ]
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in finished.items())  # none run again


def test_a_trial_a_killed_sweep_left_running_is_resumed_and_no_finished_trial_is_lost(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    plan, out = write_plan(), tmp_path / "sweep"
    assert sweep(cli_in_process, plan, out, 2).returncode == 0
    # the sweep is killed while trial 2 runs: past its checkpoint at step 80, before the end
    study = study_of(out)
    trial = study.ask({"optimizer.lr": optuna.distributions.FloatDistribution(0.001, 0.5, log=True)})
    lr = trial.params["optimizer.lr"]
    killed = subprocess.run(
        [sys.executable, "-m", "crosstrain.cli", *NULL, "-p", "crosstrain.testing.faults", "run",
         str(plan), "--backend", "momentum", "--out", str(out / "trials" / "2"), *LENGTH,
         "--set", f"optimizer.lr={lr!r}"],
        env={**worker_env(), "CROSSTRAIN_TEST_FAIL_STEP": "100"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode != 0
    finished = {path: path.stat().st_mtime_ns for path in out.glob("trials/*/summary.json")}
    result = sweep(cli_in_process, plan, out, 3)
    assert result.returncode == 0, result.stderr
    assert "continuing trial 2 (left running)" in result.stdout
    trials = study_of(out).trials
    assert len(trials) == 3 and trials[2].state.name in ("COMPLETE", "PRUNED")
    summary = json.loads((out / "trials" / "2" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 80
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in finished.items())


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ("optimizer.lrr=log(0.001,0.5)", "optimizer.lrr"),
        (
            "optimizer.lr=normal(1,2)",
            "--search optimizer.lr: 'normal(1,2)' is no space; the spaces: log(low,high)",
        ),
        (
            "optimizer.lr=log(0,1)",
            "--search optimizer.lr: log(low,high) needs a low end above 0, not log(0,1)",
        ),
        ("train.global_batch_size=int(8,20.5)", "int(low,high) needs two integers"),
    ],
)
def test_a_bad_search_is_refused_before_any_trial(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli, search: str, message: str
) -> None:
    out = tmp_path / "sweep"
    result = cli_in_process(
        *NULL, "sweep", str(write_plan()), "--trials", "2", "--search", search, "--out", str(out)
    )
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
