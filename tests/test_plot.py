"""`crosstrain plot`: learning curves of real runs, drawn into a PNG of a fixed size.

plot only reads the files a run wrote: the runs here are a numpy backend's
(:mod:`crosstrain.testing.null`), made through the CLI in pytest's process, as is every
`crosstrain plot`."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest

from crosstrain import CrosstrainError
from crosstrain.compare.folders import write_compare_file
from crosstrain.compare.launch import plan_runs
from crosstrain.core.errors import RunDirError
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plot import (
    DIFFERENCE_FLOOR,
    DIFFERENCE_PANEL,
    FIGURE_DPI,
    FIGURE_INCHES,
    build_figure,
    plot_runs,
)
from tests.conftest import EXAMPLES, InProcessCli

pytest.importorskip("matplotlib", reason="crosstrain plot needs matplotlib (the plot extra)")

DIGITS = str(EXAMPLES / "digits_mlp.toml")
PANELS = [("train loss", "loss"), ("eval loss", "loss"), ("eval accuracy", "accuracy")]


@pytest.fixture
def two_runs(tmp_path: Path, cli_in_process: InProcessCli) -> list[Path]:
    """The same plan trained on 1 and on 2 replicas, two epochs each, by the momentum backend
    (a numpy model) and shuffled by other seeds: every curve differs, so a line drawn from the
    other run shows."""
    root = tmp_path / "runs"
    runs = []
    for nproc in (1, 2):
        out = root / f"x{nproc}"
        result = cli_in_process(
            "-p",
            "crosstrain.testing.null",
            "run",
            DIGITS,
            "--backend",
            "momentum",
            "--nproc",
            str(nproc),
            "--set",
            "train.epochs=2",
            "--set",
            f"seed={nproc}",
            "--out",
            str(out),
        )
        assert result.returncode == 0, result.stderr
        runs.append(out)
    return runs


def test_the_cli_writes_a_png_of_the_fixed_size(
    two_runs: list[Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    output = tmp_path / "figures" / "curves.png"
    result = cli_in_process("plot", *map(str, two_runs), "-o", str(output))
    assert result.returncode == 0, result.stderr
    png = output.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk comes first
    assert (width, height) == (FIGURE_INCHES[0] * FIGURE_DPI, FIGURE_INCHES[1] * FIGURE_DPI)


def test_each_panel_has_one_labelled_line_per_run(two_runs: list[Path]) -> None:
    figure = build_figure(two_runs)
    assert figure.get_suptitle() == "learning curves: digits_mlp"
    assert [(axes.get_title(), axes.get_xlabel(), axes.get_ylabel()) for axes in figure.axes] == [
        *((title, "step", y_label) for title, y_label in PANELS),
        (DIFFERENCE_PANEL[0], "step", "from x1"),
    ]
    for axes in figure.axes[:3]:
        assert [line.get_label() for line in axes.get_lines()] == ["x1", "x2"]
        assert [text.get_text() for text in axes.get_legend().get_texts()] == ["x1", "x2"]
    assert [line.get_label() for line in figure.axes[3].get_lines()] == ["x2"]  # against x1
    train_loss, eval_loss, eval_accuracy, _ = figure.axes
    records = [json.loads(line) for line in (two_runs[0] / "metrics.jsonl").read_text().splitlines()]
    line = train_loss.get_lines()[0]
    assert list(line.get_xdata()) == list(range(1, 47))
    assert list(line.get_ydata()) == [record["loss"] for record in records if "eval" not in record]
    assert list(eval_accuracy.get_lines()[0].get_xdata()) == [23, 46]  # one evaluation an epoch
    assert list(eval_loss.get_lines()[1].get_ydata()) == [
        record["eval"]["loss"]
        for record in map(json.loads, (two_runs[1] / "metrics.jsonl").read_text().splitlines())
        if "eval" in record
    ]


# --------------------------------------------------------------------------- without a framework


def write_run(folder: Path, losses: list[float | None], backend: str = "torch", world_size: int = 1) -> Path:
    folder.mkdir(parents=True)
    lines = [{"step": step, "epoch": 0, "lr": 0.1, "loss": loss} for step, loss in enumerate(losses, 1)]
    lines.append({"step": len(losses), "epoch": 0, "eval": {"loss": 0.5, "count": 10.0}})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {"plan": "toy", "backend": backend, "world_size": world_size}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_a_folder_without_metrics_is_named_in_the_error(tmp_path: Path) -> None:
    good = write_run(tmp_path / "good", [1.0, 0.5])
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=re.escape(f"{tmp_path / 'empty'}: has no metrics.jsonl")) as caught:
        plot_runs([good, tmp_path / "empty"], tmp_path / "curves.png")
    assert caught.value.exit_code == 2
    assert "-p no:metrics" in str(caught.value)  # the likely reason, for a run without the plugin
    assert not (tmp_path / "curves.png").exists()


def labels_of(*folders: Path) -> list[str]:
    return [line.get_label() for line in build_figure(folders).axes[0].get_lines()]


def test_each_run_is_labelled_by_its_folder(tmp_path: Path) -> None:
    """Two torch runs at one world size are told apart by the folders the user named."""
    first, second = (write_run(tmp_path / "runs" / name, [1.0, 0.5]) for name in ("lr-0.1", "lr-0.2"))
    assert labels_of(first, second) == ["lr-0.1", "lr-0.2"]
    assert labels_of(second) == ["lr-0.2"]
    other = write_run(tmp_path / "elsewhere" / "lr-0.1", [1.0, 0.5])  # the same name, elsewhere
    assert labels_of(first, other) == ["runs/lr-0.1", "elsewhere/lr-0.1"]


def test_a_compare_folder_stands_for_its_runs_the_reference_first(tmp_path: Path) -> None:
    compare = tmp_path / "cmp"
    listed = plan_runs(["torch", "tf", "torch"], seed=0, seeds=0)
    write_compare_file(compare, load_plan(DIGITS).name, listed, tolerance=1e-4)
    for folder, backend in (("torch-0", "torch"), ("tf", "tf"), ("torch-2", "torch")):
        write_run(compare / folder, [1.0, 0.5], backend=backend)
    assert labels_of(compare) == ["cmp/torch-0", "cmp/tf", "cmp/torch-2"]
    alone = write_run(tmp_path / "alone", [2.0, 1.0])
    assert labels_of(alone, compare) == ["alone", "cmp/torch-0", "cmp/tf", "cmp/torch-2"]


def test_the_difference_panel_draws_each_candidate_against_the_reference_on_a_log_scale(
    tmp_path: Path,
) -> None:
    """Seed runs are drawn in the other panels but not differenced: they differ by design.
    A bit-equal step sits on the floor of the log scale; the tolerance is a dashed line."""
    compare = tmp_path / "cmp"
    write_compare_file(compare, "toy", plan_runs(["torch", "tf"], seed=0, seeds=1), tolerance=1e-4)
    write_run(compare / "torch", [2.0, 1.0, 0.5, 0.25])
    write_run(compare / "tf", [2.0, 1.0 + 1e-7, 0.5 * (1 + 1e-3), 0.25 * (1 - 1e-2)], backend="tf")
    write_run(compare / "torch-seed1", [2.5, 1.5, 0.8, 0.4])
    figure = build_figure([compare])
    assert [axes.get_title() for axes in figure.axes] == [
        *(title for title, _ in PANELS),
        DIFFERENCE_PANEL[0],
    ]
    train_loss, difference = figure.axes[0], figure.axes[3]
    assert len(train_loss.get_lines()) == 3  # the seed run is drawn with the others
    assert difference.get_ylabel() == "from cmp/torch" and difference.get_yscale() == "log"
    tf, tolerance = difference.get_lines()
    assert (tf.get_label(), tolerance.get_label()) == ("cmp/tf", "tolerance 0.0001")
    assert list(tf.get_xdata()) == [1, 2, 3, 4]
    assert list(tf.get_ydata()) == pytest.approx([DIFFERENCE_FLOOR, 1e-7, 1e-3, 1e-2], rel=1e-6)
    assert list(tolerance.get_ydata()) == [1e-4, 1e-4]


def test_one_run_has_no_difference_panel(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [1.0, 0.5])
    assert [axes.get_title() for axes in build_figure([run]).axes] == [title for title, _ in PANELS]


def test_plot_works_without_the_metrics_plugin_loaded(tmp_path: Path, cli_in_process: InProcessCli) -> None:
    """plot reads the files a run wrote; blocking the plugin for this command changes nothing."""
    run = write_run(tmp_path / "run", [1.0, 0.5])
    result = cli_in_process("-p", "no:metrics", "plot", str(run), "-o", str(tmp_path / "curves.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_cli_exits_2_naming_a_missing_folder(tmp_path: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process("plot", str(tmp_path / "nowhere"), "-o", str(tmp_path / "curves.png"))
    assert result.returncode == 2
    assert "nowhere: is not a folder" in result.stderr


def test_a_repeated_run_in_one_folder_plots_the_last_one_and_skips_nan(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", [3.0, 2.0, 1.0])
    with (folder / "metrics.jsonl").open("a") as stream:  # a second run into the same folder
        for step, loss in enumerate([0.9, None, 0.7], 1):  # None: a NaN loss, written as null
            stream.write(json.dumps({"step": step, "epoch": 0, "lr": 0.1, "loss": loss}) + "\n")
    figure = build_figure([folder])
    line = figure.axes[0].get_lines()[0]
    assert (list(line.get_xdata()), list(line.get_ydata())) == ([1, 3], [0.9, 0.7])
    assert figure.axes[2].get_lines() == []  # the plan had no accuracy metric


def test_without_matplotlib_the_error_names_the_plot_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path / "run", [1.0, 0.5])
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    with pytest.raises(CrosstrainError, match=re.escape("pip install 'crosstrain[plot]'")):
        plot_runs([run], tmp_path / "curves.png")
