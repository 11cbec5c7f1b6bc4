"""The progress plugin: a bar on a terminal, plain lines in a pipe, epoch lines in both.

The CLI runs in pytest's process on the momentum backend (a numpy model:
:mod:`crosstrain.testing.null`): the plugin chooses from rank 0's stdout, which is a
tty-like stream for the terminal cases and captured (a pipe) for the others."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from crosstrain.core.run.context import RunContext
from crosstrain.core.run.job import Job, Layout, World
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins.progress import ProgressReporter
from tests.conftest import EXAMPLES, InProcessCli

DIGITS = str(EXAMPLES / "digits_mlp.toml")
NULL = ("-p", "crosstrain.testing.null")
ANSI_SEQUENCE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
BAR_GLYPH = "━"
EPOCH_LINE = re.compile(
    r"^epoch (\d+)/2  loss \d+\.\d{4}  eval_loss \d+\.\d{4}  eval_acc \d\.\d{4}  \d+ samples/s$"
)
STEP_LINE = re.compile(
    r"^step (\d+)/46 \(\d+%\)  epoch [12]/2  loss \d+\.\d{4}  lr \d\.\d\de-\d\d  \d+ samples/s"
    r"  eta \d+:\d\d:\d\d$"
)
# 1,797 digits, 20 % held out: 1,438 training rows in batches of 64 -> 23 steps an epoch
TWO_EPOCHS = ("--set", "train.epochs=2")


def console_env(**extra: str) -> Mapping[str, str | None]:
    """The CLI's environment without variables that force or forbid terminal features, and
    the size of the terminal (rich reads it from these when the stream is no real tty)."""
    unset = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    return {**dict.fromkeys(unset), "COLUMNS": "160", "LINES": "40", **extra}


def screen_pieces(output: str) -> list[str]:
    """Every piece of text written between carriage returns and newlines, escape codes removed."""
    return [piece for piece in re.split(r"[\r\n]+", ANSI_SEQUENCE.sub("", output)) if piece]


def epoch_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if EPOCH_LINE.match(line)]


def assert_bar_stopped(output: str) -> None:
    """The bar hid the cursor while it ran and gave it back before anything else was printed."""
    assert HIDE_CURSOR in output
    assert output.rfind(SHOW_CURSOR) > output.rfind(HIDE_CURSOR)


def test_a_terminal_shows_a_progress_bar_and_keeps_one_line_per_epoch(
    tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    result = cli_in_process(
        *NULL,
        "run",
        DIGITS,
        "--backend",
        "momentum",
        "--nproc",
        "2",
        *TWO_EPOCHS,
        "--out",
        str(tmp_path / "run"),
        env=console_env(TERM="xterm-256color"),
        terminal=True,
    )
    code, output = result.returncode, result.stdout
    assert code == 0, output
    pieces = screen_pieces(output)
    bars = [piece for piece in pieces if BAR_GLYPH in piece]
    assert bars, output
    # the last drawing of the bar, at the end of training: every element is there
    assert re.search(
        r"epoch 2/2 ━+ 46/46 loss \d\.\d{4} lr \d\.\d\de-\d\d \d+ samples/s ETA "
        r"\d+:\d\d:\d\d",
        bars[-1],
    ), bars[-1]
    assert [line.split()[1] for line in epoch_lines(pieces)] == ["1/2", "2/2"]
    assert_bar_stopped(output)
    assert "digits_mlp on momentum x2" in output.rsplit(SHOW_CURSOR, 1)[1]  # the summary comes after


def test_a_pipe_gets_plain_lines_without_escape_codes(tmp_path: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process(
        *NULL,
        "run",
        DIGITS,
        "--backend",
        "momentum",
        "--nproc",
        "2",
        *TWO_EPOCHS,
        "--out",
        str(tmp_path / "run"),
        env=console_env(TERM="xterm-256color"),
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and BAR_GLYPH not in result.stdout
    lines = result.stdout.splitlines()
    steps = [int(match.group(1)) for line in lines if (match := STEP_LINE.match(line))]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40, 45, 46]
    assert len(epoch_lines(lines)) == 2
    # the first epoch's line sits between its last step line and the second epoch's first (23 steps each)
    first_epoch = lines.index(epoch_lines(lines)[0])
    assert lines[first_epoch - 1].startswith("step 20/") and lines[first_epoch + 1].startswith("step 25/")


def test_a_failing_run_stops_the_bar_before_the_error_is_shown(
    tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    env = console_env(TERM="xterm-256color", CROSSTRAIN_TEST_FAIL_RANK="0")
    result = cli_in_process(
        *NULL,
        "-p",
        "crosstrain.testing.faults",
        "run",
        DIGITS,
        "--backend",
        "momentum",
        "--out",
        str(tmp_path / "run"),
        env=env,
        terminal=True,
    )
    code, output = result.returncode, result.stdout
    assert code == 1, output
    assert_bar_stopped(output)
    assert "injected failure at step 3" in output.rsplit(SHOW_CURSOR, 1)[1]


# --------------------------------------------------------------------------- in-process


def digits_context(process_index: int = 0) -> RunContext:
    plan = load_plan(DIGITS, ["train.epochs=2"])
    return RunContext(
        job=Job(plan=plan, layout=Layout("torch", 2)),
        world=World(process_index, 2),
        total_steps=46,
        steps_per_epoch=23,
        train_rows=1438,
        eval_rows=359,
    )


def drive(reporter: ProgressReporter, context: RunContext) -> None:
    """The hooks' calls of a two-epoch run of 23 steps each."""
    reporter.start(context)
    for step in range(1, 47):
        epoch = (step - 1) // 23
        reporter.step(step, epoch, 0.001, {"loss": 1.0 / step})
        if step % 23 == 0:
            reporter.epoch(
                context,
                epoch,
                {"loss": 0.5, "samples_per_second": 1000.0, "eval_loss": 0.4, "eval_accuracy": 0.9},
            )
    reporter.close()


def test_plain_lines_come_every_tenth_of_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    drive(ProgressReporter(), digits_context())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "digits_mlp (seed 0): 46 steps (2 epochs) on torch x2"
    steps = [int(match.group(1)) for line in lines if (match := STEP_LINE.match(line))]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40, 45, 46]
    assert epoch_lines(lines) == [
        "epoch 1/2  loss 0.5000  eval_loss 0.4000  eval_acc 0.9000  1000 samples/s",
        "epoch 2/2  loss 0.5000  eval_loss 0.4000  eval_acc 0.9000  1000 samples/s",
    ]


def test_other_ranks_print_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    drive(ProgressReporter(), digits_context(process_index=1))
    assert capsys.readouterr().out == ""


def test_epoch_count_follows_max_steps(tmp_path: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process(
        *NULL,
        "-p",
        "no:tensorboard",
        "run",
        DIGITS,
        "--backend",
        "momentum",
        "--nproc",
        "1",
        "--set",
        "train.max_steps=30",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.returncode == 0, result.stderr
    # 23 steps an epoch at batch 64: max_steps ends the run in the second of the plan's 20 epochs
    assert result.stdout.startswith("digits_mlp (seed 0): 30 steps (max_steps; 1.3 epochs) on momentum x1\n")
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("epoch ")] == [
        "1/2",
        "2/2",
    ]


def test_the_lines_show_mfu_from_the_plans_flops_and_the_peak_given(
    tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """The digits MLP does 2 x (64*128 + 128*64 + 64*10) forward FLOPs a row, 3 x that a
    training row; against --peak-tflops on 2 devices, each line's MFU is its samples/s'."""
    arguments = ("--backend", "momentum", "--nproc", "2", *TWO_EPOCHS, "--peak-tflops", "0.001")
    out = ("--out", str(tmp_path / "run"))
    result = cli_in_process(*NULL, "run", DIGITS, *arguments, *out, env=console_env())
    assert result.returncode == 0, result.stderr
    flops = 3 * 2 * (64 * 128 + 128 * 64 + 64 * 10)
    shown = [
        (float(match[1]), float(match[2]))
        for line in result.stdout.splitlines()
        if (match := re.search(r"  (\d+) samples/s  MFU (\d+\.\d)%", line))
    ]
    assert len(shown) == 10 + 2  # every step line and both epoch lines
    for speed, mfu in shown:
        assert mfu == pytest.approx(100 * speed * flops / (0.001e12 * 2), abs=0.05 + 100 * flops / 2e9)


def test_without_a_known_peak_no_mfu_is_shown(tmp_path: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process(*NULL, "run", DIGITS, "--backend", "momentum", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "MFU" not in result.stdout
