"""The null plugin's backends (crosstrain.testing.null) through the real CLI: from a shell
without a framework, and in pytest's process, where a failed run resumed from its last
checkpoint trains exactly as an uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from crosstrain.core.run.checkpoint import complete_checkpoints
from crosstrain.testing import step_losses, summary
from tests.conftest import InProcessCli, worker_env

NULL = ("-p", "crosstrain.testing.null")
#: a shell's `crosstrain` on the null backend, then whether a framework was imported
FROM_A_SHELL = """
import sys
from crosstrain.cli import main
code = main(sys.argv[1:])
print(sorted({"torch", "tensorflow", "keras"} & set(sys.modules)))
sys.exit(code)
"""


def test_a_shell_runs_the_null_backend_without_a_framework(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    command = [*NULL, "-p", "no:progress", "run", str(write_plan()), "--backend", "null", "--nproc", "2"]
    result = subprocess.run(
        [sys.executable, "-c", FROM_A_SHELL, *command, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"  # no framework imported
    assert summary(tmp_path / "run")["world_size"] == 2 and summary(tmp_path / "run")["processes"] == 1
    assert list(step_losses(tmp_path / "run")) == [float(step) for step in range(1, 46)]  # 1,438 rows / 32


def test_a_failed_run_resumes_as_if_uninterrupted(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    plan = str(write_plan())
    settings = ("--set", "train.max_steps=60", "--set", "train.epochs=2")
    settings += ("--set", "output.checkpoint_every_steps=20", "--set", "output.log_every_steps=1")

    def run(out: str, *flags: str, plugins: tuple[str, ...] = (), env: dict[str, str] | None = None) -> int:
        arguments = ("run", plan, "--backend", "momentum", "--out", str(tmp_path / out), *settings, *flags)
        return cli_in_process(*NULL, *plugins, *arguments, env=env).returncode

    assert run("whole") == 0
    faults = {"CROSSTRAIN_TEST_FAIL_STEP": "45"}  # rank 0 raises at step 45, after checkpoint 40
    assert run("broken", plugins=("-p", "crosstrain.testing.faults"), env=faults) == 1
    assert [step for step, _ in complete_checkpoints(tmp_path / "broken")] == [20, 40]
    assert run("broken", "--resume") == 0
    whole, resumed = summary(tmp_path / "whole"), summary(tmp_path / "broken")
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == 60
    assert resumed["train"] == whole["train"] and resumed["eval"] == whole["eval"]
    # each step logged once, and each the uninterrupted run's, bit for bit
    records = [json.loads(line) for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "loss" in record] == list(range(1, 61))
    assert list(step_losses(tmp_path / "broken")) == list(step_losses(tmp_path / "whole"))


def test_what_one_process_cannot_do_is_refused_before_launch(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    plan, out = str(write_plan()), str(tmp_path / "run")
    refused = {
        ("--workers", "2"): "crosstrain: error: --workers 2: the null backend runs in one process",
        ("--device", "gpu"): "crosstrain: error: --device gpu: the null backend runs on the CPU",
        ("--max-restarts", "1"): "crosstrain: error: --max-restarts: the null backend cannot restart",
    }
    for flags, message in refused.items():
        result = cli_in_process(*NULL, "run", plan, "--backend", "null", "--out", out, *flags)
        assert result.returncode == 2 and result.stderr.startswith(message), result.stderr
    assert not (tmp_path / "run").exists()
