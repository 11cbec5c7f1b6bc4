"""The tensorboard plugin: `--tensorboard [DIR]`, event files written by rank 0 only, read back.

What the plugin does with the option and the hooks is checked in pytest's process on a
numpy backend (:mod:`crosstrain.testing.null`) with a writer that records; each framework's
writer writes real event files in one real run of its backend."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crosstrain.core.run.context import RunContext
from crosstrain.core.run.job import Job, LaunchOptions, Layout, World
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins import tensorboard
from tests.conftest import EXAMPLES, InProcessCli, run_cli, worker_env

DIGITS = str(EXAMPLES / "digits_mlp.toml")
SCALAR_TAGS = {"train/loss", "train/lr", "eval/loss", "eval/accuracy"}


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the folder's event files, by tag, as (step, value) in file order.

    tensorboard's loader reads both writers' files (torch's simple values and tf.summary's
    tensors) without importing tensorflow."""
    pytest.importorskip("tensorboard", reason="reading event files needs the tensorboard package")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, float(make_ndarray(value.tensor))))
    return scalars


def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_events_match_metrics(log_dir: Path, run_dir: Path, steps: int) -> None:
    """The event file holds what metrics.jsonl holds: every step's loss and lr, every evaluation."""
    assert_scalars_match_metrics(read_scalars(log_dir), run_dir, steps)


def assert_scalars_match_metrics(
    scalars: dict[str, list[tuple[int, float]]], run_dir: Path, steps: int
) -> None:
    """The scalars written, by tag, are what metrics.jsonl holds."""
    assert set(scalars) == SCALAR_TAGS
    records = metrics_records(run_dir)
    step_records = [record for record in records if "eval" not in record]
    eval_records = [record for record in records if "eval" in record]
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, steps + 1))
    assert [value for _, value in scalars["train/loss"]] == pytest.approx(
        [record["loss"] for record in step_records], rel=1e-6
    )
    assert [value for _, value in scalars["train/lr"]] == pytest.approx(
        [record["lr"] for record in step_records], rel=1e-6
    )
    for name in ("loss", "accuracy"):
        evaluations = [record["eval"] for record in eval_records]
        assert [step for step, _ in scalars[f"eval/{name}"]] == [record["step"] for record in eval_records]
        assert [value for _, value in scalars[f"eval/{name}"]] == pytest.approx(
            [evaluation[name] for evaluation in evaluations], rel=1e-6
        )


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_torch_run_writes_one_event_file_of_loss_lr_and_eval(tmp_path: Path) -> None:
    # a relative DIR is the CLI's working directory's, even though workers write it
    result = run_cli(
        "run",
        DIGITS,
        "--backend",
        "torch",
        "--nproc",
        "2",
        "--set",
        "train.epochs=2",
        "--out",
        "run",
        "--tensorboard",
        "board",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    log_dir = tmp_path / "board"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # rank 0's only
    assert_events_match_metrics(log_dir, tmp_path / "run", steps=46)
    assert not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.tf
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_a_tf_run_writes_its_events_into_the_run_folder_by_default(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        "run",
        DIGITS,
        "--backend",
        "tf",
        "--nproc",
        "2",
        "--set",
        "train.epochs=2",
        "--out",
        str(run_dir),
        "--tensorboard",
    )
    assert result.returncode == 0, result.stderr
    assert_events_match_metrics(run_dir / "tensorboard", run_dir, steps=46)


TF_WRITER_SCRIPT = """
import sys
from pathlib import Path
import tensorflow  # the running backend's framework, imported before the writer is chosen
from crosstrain.plugins.tensorboard import open_scalar_writer
writer = open_scalar_writer(Path(sys.argv[1]))
for step in (1, 2, 3):
    writer.scalar("train/loss", 1.0 / step, step)
writer.close()
print(type(writer).__name__)
"""


@pytest.mark.tf
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_a_process_that_imported_tensorflow_writes_with_tf_summary(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", TF_WRITER_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["TensorflowScalarWriter"]
    assert read_scalars(tmp_path) == {"train/loss": [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]}


# --------------------------------------------------------------------------- in-process


class RecordingWriter:
    """A framework's writer as the plugin sees it: where it was opened, every scalar by tag."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.closed = False

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.setdefault(tag, []).append((step, value))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def recording_writers(monkeypatch: pytest.MonkeyPatch) -> list[RecordingWriter]:
    """The plugin writes through a :class:`RecordingWriter`, whatever is installed: those it
    opened."""
    opened: list[RecordingWriter] = []

    def open_writer(log_dir: Path) -> RecordingWriter:
        opened.append(RecordingWriter(log_dir))
        return opened[-1]

    monkeypatch.setattr(tensorboard, "writer_installed", lambda: True)
    monkeypatch.setattr(tensorboard, "WRITERS", {"recording": open_writer})
    return opened


def run_momentum(cli: InProcessCli, cwd: Path, out: str, *tensorboard_option: str) -> None:
    """The digits plan on the momentum backend (2 replicas, 2 epochs: 46 steps) in this process."""
    result = cli(
        *("-p", "crosstrain.testing.null", "run", DIGITS, "--backend", "momentum", "--nproc", "2"),
        *("--set", "train.epochs=2", "--out", out, *tensorboard_option),
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr


def test_a_run_writes_loss_lr_and_eval_into_the_folder_named(
    tmp_path: Path, recording_writers: list[RecordingWriter], cli_in_process: InProcessCli
) -> None:
    # a relative DIR is the CLI's working directory's: made absolute where the option is
    # parsed, for workers that may run elsewhere
    run_momentum(cli_in_process, tmp_path, "run", "--tensorboard", "board")
    (writer,) = recording_writers  # one writer: rank 0's
    assert writer.log_dir == tmp_path / "board" and writer.log_dir.is_dir() and writer.closed
    assert_scalars_match_metrics(writer.scalars, tmp_path / "run", steps=46)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_without_a_folder_the_events_go_into_the_run_folder(
    tmp_path: Path, recording_writers: list[RecordingWriter], cli_in_process: InProcessCli
) -> None:
    run_momentum(cli_in_process, tmp_path, str(tmp_path / "run"), "--tensorboard")
    (writer,) = recording_writers
    assert writer.log_dir == tmp_path / "run" / "tensorboard"
    assert_scalars_match_metrics(writer.scalars, tmp_path / "run", steps=46)
    run_momentum(cli_in_process, tmp_path, str(tmp_path / "plain"))  # not asked for: no writer
    assert len(recording_writers) == 1


def test_only_rank_0_opens_a_writer(tmp_path: Path, recording_writers: list[RecordingWriter]) -> None:
    logger = tensorboard.TensorboardLogger()
    job = Job(
        plan=load_plan(DIGITS),
        layout=Layout("any", 1),
        launch=LaunchOptions(options={"tensorboard": True}),
        out_dir=str(tmp_path),
    )
    for rank in (1, 0):
        context = RunContext(
            job=job, world=World(rank, 2), total_steps=1, steps_per_epoch=1, train_rows=1, eval_rows=0
        )
        logger.start(context)
        logger.step(1, 0.1, {"loss": 1.0})
        logger.close()
    (writer,) = recording_writers
    assert writer.scalars == {"train/loss": [(1, 1.0)], "train/lr": [(1, 0.1)]}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tensorboard.crosstrain_addoption(parser)
    return parser.parse_args(list(argv))


def context_with(option: object, out_dir: Path) -> RunContext:
    job = Job(
        plan=load_plan(DIGITS),
        layout=Layout("any", 1),
        launch=LaunchOptions(options={"tensorboard": option}),
        out_dir=str(out_dir),
    )
    return RunContext(job=job, world=World(), total_steps=1, steps_per_epoch=1, train_rows=1, eval_rows=0)


def test_the_option_names_a_folder_or_defaults_to_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # what is installed is not this test's concern (the core env has no writer at all)
    monkeypatch.setattr(tensorboard, "writer_installed", lambda: True)
    out = tmp_path / "out"

    def log_dir(*argv: str) -> Path | None:
        return tensorboard.log_dir_for(context_with(parse(*argv).tensorboard, out))

    assert log_dir() is None
    assert log_dir("--tensorboard") == out / "tensorboard"
    assert log_dir("--tensorboard", "tb") == tmp_path / "tb"  # absolute, for workers elsewhere
    assert tensorboard.log_dir_for(context_with(True, out)) == out / "tensorboard"  # crosstrain.fit(options=)


def test_without_a_framework_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("torch", "torch.utils.tensorboard", "tensorflow"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    extra = r"pip install 'crosstrain\[tensorboard\]'"
    with pytest.raises(tensorboard.TensorboardError, match=extra) as caught:
        tensorboard.open_scalar_writer(tmp_path)
    assert caught.value.exit_code == 2
    assert "torch:" in str(caught.value) and "tensorflow:" in str(caught.value)


@pytest.mark.parametrize("missing", [("tensorboard", "tensorflow"), ("torch", "tensorflow")])
def test_a_missing_writer_is_refused_when_the_option_is_parsed(
    missing: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any process starts, naming the extra: torch's writer needs the tensorboard
    package beside torch, tf.summary needs tensorflow."""
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # find_spec now finds nothing
    assert not tensorboard.writer_installed()
    assert parse().tensorboard is None  # not asked for: nothing is checked
    with pytest.raises(SystemExit) as exited:
        parse("--tensorboard")
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "argument --tensorboard" in error and "pip install 'crosstrain[tensorboard]'" in error


def test_a_writer_counts_as_installed_with_tensorflow_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("torch", "tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "tensorflow", sys)  # any module object: "installed"
    assert tensorboard.writer_installed()
