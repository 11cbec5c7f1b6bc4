"""An image folder (the digits as 16x16 PNG and JPEG files) trained with augmentation
through the CLI: the same per-step losses on torch and tf, at world 1 and 2, and after a
resume mid-epoch; a bad file refused before launch, a damaged one met mid-epoch named with
its rank; evaluate and predict read the run's classes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.batches import GlobalSampler
from crosstrain.core.data.sources.images import ImageRows
from crosstrain.core.run.checkpoint import complete_checkpoints
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.data_plans import damaged_png
from crosstrain.testing.launches import RunCache, run_cli, train_refused, write_plan
from crosstrain.testing.run_checks import fail_then_resume
from tests.support import step_losses

pytest.importorskip("torch")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross

STEPS = "train.max_steps=30"  # past the end of the first epoch (22 steps): epoch 1's draws too


def test_torch_and_tf_train_an_augmented_image_folder_to_the_same_losses(runs: RunCache) -> None:
    torch_run, tf_run = runs("torch", "image_folder", 1, STEPS), runs("tf", "image_folder", 1, STEPS)
    torch_losses, tf_losses = step_losses(torch_run), step_losses(tf_run)
    assert len(torch_losses) == 30
    assert np.abs(torch_losses - tf_losses).max() <= 1e-4
    assert json.loads((torch_run / "classes.json").read_text()) == [str(digit) for digit in range(10)]


def test_resized_by_opencv_torch_and_tf_still_train_to_the_same_losses(runs: RunCache) -> None:
    """``data.antialias = false``: the workers decode and resize with OpenCV, the same rows
    on both frameworks, mixing and every other augmentation on (2.4e-7 apart over 30 steps)."""
    settings = (STEPS, "data.antialias=false")
    torch_run, tf_run = runs("torch", "image_folder", 1, *settings), runs("tf", "image_folder", 1, *settings)
    assert np.abs(step_losses(torch_run) - step_losses(tf_run)).max() <= 1e-4


def test_two_processes_each_decoding_their_shard_train_as_one(runs: RunCache) -> None:
    one, two = runs("torch", "image_folder", 1, STEPS), runs("torch", "image_folder", 2, STEPS)
    assert np.abs(step_losses(one) - step_losses(two)).max() <= 1e-5


def test_a_run_killed_mid_epoch_resumes_to_the_same_steps(runs: RunCache, tmp_path: Path) -> None:
    """Killed at step 8, resumed from step 5's checkpoint, inside the first epoch: every
    step's crops and flips are drawn again as they were."""
    uninterrupted = runs("torch", "image_folder", 1, STEPS)
    resumed = fail_then_resume("torch", write_plan(tmp_path, "image_folder"), tmp_path / "run", 1)
    losses = step_losses(resumed)
    assert np.array_equal(losses, step_losses(uninterrupted)[: len(losses)])


def test_an_unreadable_image_is_refused_before_launch(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, "image_folder")
    (tmp_path / "digits_images" / "3" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    line = train_refused("torch", plan, tmp_path / "run")
    assert "data.path: cannot read image" in line and "3/broken.jpg" in line


def test_a_damaged_image_met_mid_epoch_is_one_line_naming_the_file_and_rank(tmp_path: Path) -> None:
    """A PNG whose header and end are whole but whose pixels are scrambled (the check before
    launch passes it), in rank 1's half of a later step: that step ends the run with exit 2
    and one line on stderr naming the file, rank 1 and the run folder's error.log, which
    keeps the worker's traceback; the checkpoints before it stay."""
    plan_path = write_plan(tmp_path, "image_folder")
    damaged, step = _file_read_at_a_later_step(plan_path, ".png", rank=1, ranks=2)
    damaged.write_bytes(damaged_png(damaged.read_bytes()))
    run = tmp_path / "run"
    result = run_cli(
        "-p", "no:progress", "run", str(plan_path), "--backend", "torch", "--nproc", "2", "--device", "cpu",
        "--out", str(run), "--set", "output.checkpoint_every_steps=1",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"crosstrain: error: rank 1 failed: cannot decode image {damaged}: "), line
    assert line.endswith(f"(traceback: {run / 'error.log'})"), line
    log = (run / "error.log").read_text()
    assert "Traceback (most recent call last):" in log and f"InputError: cannot decode image {damaged}" in log
    assert complete_checkpoints(run)[-1][0] == step  # every step before it kept


def _file_read_at_a_later_step(plan_path: Path, suffix: str, rank: int, ranks: int) -> tuple[Path, int]:
    """A training file ending in ``suffix`` first read at step 3 or later, by ``rank`` of
    ``ranks`` (each reads its contiguous part of the global batch), and that step."""
    plan = load_plan(plan_path)
    train = load_datasets(plan).train
    rows = train.x.raw if hasattr(train.x, "raw") else train.x
    assert isinstance(rows, ImageRows)
    sampler = GlobalSampler(len(train), plan.train.global_batch_size, plan.seed)
    part = plan.train.global_batch_size // ranks
    for step, (indices, _) in enumerate(sampler.epoch(0)):
        mine = [str(rows.paths[row]) for row in indices[rank * part : (rank + 1) * part]]
        found = [path for path in mine if path.endswith(suffix)]
        if step >= 3 and found:
            return Path(found[0]), step
    raise AssertionError(f"no {suffix} file read after step 3")


def test_evaluate_and_predict_read_the_run_s_images(runs: RunCache, tmp_path: Path) -> None:
    run = runs("torch", "image_folder", 1, STEPS)
    evaluated = run_cli("evaluate", str(run), "--backend", "tf", "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads(evaluated.stdout)["eval"]["loss"] == pytest.approx(summary["eval"]["loss"], abs=1e-5)
    folder = run.parent / "digits_images" / "7"
    predicted = run_cli("predict", str(run), "--data", str(folder), "--out", str(tmp_path / "logits.npy"))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert np.load(tmp_path / "logits.npy").shape == (len(list(folder.iterdir())), 10)


def test_a_run_reading_the_decoded_cache_trains_as_the_run_decoding_the_files(
    runs: RunCache, tmp_path: Path
) -> None:
    """``crosstrain data cache``, then the plan with ``data.cache``: the steps of the run that
    decoded the files, bit for bit (these 16x16 images never decode at a reduced JPEG scale,
    so the cached pixels are the decoded ones)."""
    plan = write_plan(tmp_path, "image_folder")
    cache = ("--set", f"data.cache={tmp_path / 'digits.cache'}")
    written = run_cli("data", "cache", str(plan), *cache)
    assert written.returncode == 0, written.stderr[-3000:]
    out = tmp_path / "run"
    command = ("run", str(plan), "--backend", "torch", "--device", "cpu", "--out", str(out))
    trained = run_cli(*command, "--set", STEPS, *cache)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert np.array_equal(step_losses(out), step_losses(runs("torch", "image_folder", 1, STEPS)))
