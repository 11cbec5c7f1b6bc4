"""A run continued through the real CLI on torch: a finished run trained further, a damaged
newest checkpoint skipped, a changed plan refused. Two runs of the dropout MLP serve every
test (each test continues its own copy of the shorter one): 30 steps, and an uninterrupted
60, both started with checkpoints every 10 steps (a constant schedule: the length changes
no learning rate)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.admission.runfolder import read_launch_record
from crosstrain.core.run.checkpoint import complete_checkpoints
from crosstrain.core.run.job import Layout
from crosstrain.testing.launches import made_once, run_cli, shared_folder, write_plan
from crosstrain.testing.runs import step_losses, summary

pytestmark = pytest.mark.torch

STARTED = ("--set", "train.epochs=2", "--set", "output.checkpoint_every_steps=10")


def _train(plan: Path, out: Path, steps: int) -> Path:
    result = run_cli(
        "-p", "no:progress", "run", str(plan), "--backend", "torch", "--device", "cpu", "--out", str(out),
        *STARTED, "--set", f"train.max_steps={steps}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The 30-step run and the uninterrupted 60-step run, made once per session."""

    def make(folder: Path) -> None:
        plan = write_plan(folder, "dropout_mlp")
        _train(plan, folder / "thirty", 30), _train(plan, folder / "sixty", 60)

    folder = made_once(shared_folder(tmp_path_factory) / "continued", make)
    return folder / "thirty", folder / "sixty"


def _continue(run: Path, *flags: str) -> tuple[int, list[str]]:
    """``crosstrain run --out RUN --resume FLAGS``: no plan file, the run's overrides not
    typed again; the exit code and the lines it wrote to stderr."""
    result = run_cli("-p", "no:progress", "run", "--out", str(run), "--resume", "--device", "cpu", *flags)
    return result.returncode, result.stderr.strip().splitlines()


def _checkpoint_steps(run: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(run)]


def test_a_finished_run_continues_to_a_new_end(finished: tuple[Path, Path], tmp_path: Path) -> None:
    """A finished 30-step run, continued to 60 from its final checkpoint, takes the
    uninterrupted run's steps 31-60 bit for bit and writes its checkpoints."""
    thirty, sixty = finished
    run = Path(shutil.copytree(thirty, tmp_path / "run"))
    code, lines = _continue(run, "--set", "train.max_steps=60")
    assert code == 0, lines
    assert summary(run)["resumed_from_step"] == 30 and summary(run)["steps"] == 60
    assert np.array_equal(step_losses(run), step_losses(sixty))  # steps 1-30 kept, 31-60 the same
    assert _checkpoint_steps(run) == _checkpoint_steps(sixty) == [40, 50, 60]
    assert summary(run)["eval"] == summary(sixty)["eval"]


def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_resumed(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    """A truncated model.safetensors in the newest checkpoint: one line names it, the run
    resumes from the checkpoint before it and ends as the uninterrupted run."""
    thirty, sixty = finished
    run = Path(shutil.copytree(thirty, tmp_path / "run"))
    damaged = run / "checkpoints" / "step-00000030" / "model.safetensors"
    size = damaged.stat().st_size
    damaged.write_bytes(damaged.read_bytes()[:-100])
    code, lines = _continue(run, "--set", "train.max_steps=60")
    assert code == 0, lines
    assert [line for line in lines if str(damaged) in line] == [
        f"crosstrain: --resume: {damaged} is damaged ({size - 100} bytes, its manifest says {size}); "
        f"resuming from step-00000020, the newest intact checkpoint"
    ], lines
    assert not [line for line in lines if "Traceback" in line or "SafetensorError" in line]
    assert summary(run)["resumed_from_step"] == 20
    assert np.array_equal(step_losses(run), step_losses(sixty))
    assert _checkpoint_steps(run) == [40, 50, 60] and summary(run)["eval"] == summary(sixty)["eval"]


def test_a_changed_plan_is_refused_before_launch(finished: tuple[Path, Path], tmp_path: Path) -> None:
    """``--set optimizer.lr=0.5`` on --resume: one line naming the field with both values,
    exit 2, and nothing in the run folder changed."""
    run = Path(shutil.copytree(finished[0], tmp_path / "run"))
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    code, lines = _continue(run, "--set", "optimizer.lr=0.5", "--set", "train.max_steps=60")
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        "crosstrain: error: --resume: optimizer.lr: 0.003 in the run, 0.5 now; only the output section"
    )
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


def test_a_flag_overrides_one_part_of_the_run_s_layout_and_the_header_says_so(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    """The 30-step torch x1 run on --device cpu, continued with ``--nproc 2`` alone: it runs
    on torch x2 (the backend and device its launch.json recorded), its first line names the
    world it was, and launch.json records the new one for the next --resume."""
    run = Path(shutil.copytree(finished[0], tmp_path / "run"))
    result = run_cli("run", "--out", str(run), "--resume", "--nproc", "2", "--set", "train.max_steps=40")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == (
        "dropout_mlp (seed 3): 40 steps (max_steps; 0.9 epochs) on torch x2, "
        "resumed at step 30 (was torch x1)"
    )
    assert (summary(run)["backend"], summary(run)["world_size"], summary(run)["steps"]) == ("torch", 2, 40)
    assert read_launch_record(run) == Layout("torch", 2, device="cpu")


def test_a_max_steps_past_the_epochs_end_is_refused_naming_train_epochs(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    """The run's train.epochs = 2 ends it at step 90 (45 steps an epoch): train.max_steps=200
    alone would stop there, so it is refused before launch, in one line naming train.epochs."""
    run = Path(shutil.copytree(finished[0], tmp_path / "run"))
    code, lines = _continue(run, "--set", "train.max_steps=200")
    assert code == 2
    assert lines == [
        "crosstrain: error: --resume: train.max_steps = 200 lies past the end of train.epochs = 2 "
        "(step 90), which would stop the run first; --set train.epochs=5 too reaches step 200"
    ]
