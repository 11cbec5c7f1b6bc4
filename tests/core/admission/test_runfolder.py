"""The run folder: never silently reused, never shared by two runs at once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.admission.runfolder import open_run_folder
from crosstrain.core.errors import RunFolderError


def test_a_new_or_empty_folder_is_used(tmp_path: Path) -> None:
    (tmp_path / "plan.toml").write_text("")  # a user's file beside the run is no run
    with open_run_folder(tmp_path / "new"), open_run_folder(tmp_path):
        pass
    assert (tmp_path / "plan.toml").exists()


def test_a_folder_holding_a_run_needs_resume_or_overwrite(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "plan.toml").write_text("")
    with pytest.raises(RunFolderError, match="already holds a run; --resume continues it, --overwrite"):
        open_run_folder(tmp_path).__enter__()
    with pytest.raises(RunFolderError, match="has no complete checkpoint"):
        open_run_folder(tmp_path, resume=True).__enter__()
    with open_run_folder(tmp_path, overwrite=True):
        assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "plan.toml").exists()  # overwrite removes run outputs only


def test_resume_needs_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="no run folder"):
        open_run_folder(tmp_path / "missing", resume=True).__enter__()


def test_two_runs_cannot_share_a_folder(tmp_path: Path) -> None:
    code = (
        "import sys; from crosstrain.core.admission.runfolder import open_run_folder\n"
        "try:\n    open_run_folder(sys.argv[1]).__enter__()\n"
        "except Exception as error:\n    print(error)"
    )
    with open_run_folder(tmp_path):
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert "is in use by another run (pid " in other.stdout, other.stderr
    with open_run_folder(tmp_path):  # released when the first run ends
        pass


def test_the_plans_output_dir_is_the_default_run_folder(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    from crosstrain.api import LaunchOptions, make_job
    from crosstrain.core.spec.planfile import load_plan

    plan = load_plan(write_plan(), [f"output.dir='{tmp_path / 'planned'}'"])
    assert make_job(plan, LaunchOptions()).out_dir == str(tmp_path / "planned")
    flag = LaunchOptions(out=tmp_path / "flag")
    assert make_job(plan, flag).out_dir == str(tmp_path / "flag")  # --out wins


def test_the_plan_as_run_is_kept_and_read_back(tmp_path: Path) -> None:
    """plan.json: what evaluate, predict and export rebuild the model from; overrides and
    absolute data paths included, and a run output that --overwrite replaces."""
    from crosstrain.core.admission.runfolder import PLAN_FILE, RUN_OUTPUTS, read_run_plan, write_run_plan
    from crosstrain.core.spec.planfile import load_plan
    from crosstrain.testing.data_plans import write_tokens
    from crosstrain.testing.plans import GPT_PLAN

    write_tokens(str(tmp_path / "tokens.npy"))
    (tmp_path / "gpt.toml").write_text(GPT_PLAN)
    plan = load_plan(tmp_path / "gpt.toml", ["optimizer.lr=0.5"])
    (tmp_path / "run").mkdir()
    write_run_plan(tmp_path / "run", plan)
    again = read_run_plan(tmp_path / "run")
    assert again == plan and again.optimizer.lr == 0.5
    assert again.data.path == str((tmp_path / "tokens.npy").resolve())
    assert PLAN_FILE in RUN_OUTPUTS
    (tmp_path / "run" / PLAN_FILE).write_text("{not json")
    with pytest.raises(RunFolderError, match=r"plan\.json: not a crosstrain plan file"):
        read_run_plan(tmp_path / "run")


def test_a_continued_run_keeps_its_plan_and_changes_only_what_may_change(tmp_path: Path) -> None:
    """--resume: the run's plan.json (its overrides included) is the plan; what the plan file
    and --set state now may change the output section and the run's length, anything else
    is refused naming each field with both values. Data paths compare resolved."""
    from crosstrain.core.admission.runfolder import continued_plan, write_run_plan
    from crosstrain.core.errors import InputError
    from crosstrain.core.spec.planfile import load_plan
    from crosstrain.testing.data_plans import write_tokens
    from crosstrain.testing.plans import GPT_PLAN

    write_tokens(str(tmp_path / "tokens.npy"))
    (tmp_path / "gpt.toml").write_text(GPT_PLAN)
    started = ["optimizer.lr=0.5", "output.checkpoint_every_steps=20"]
    (tmp_path / "run").mkdir()
    write_run_plan(tmp_path / "run", load_plan(tmp_path / "gpt.toml", started))
    stated = ["name", "data.path", "model.layers", "optimizer.name", "train.epochs"]  # the file's, not lr
    longer = load_plan(tmp_path / "gpt.toml", ["train.epochs=3"])
    plan, changes = continued_plan(tmp_path / "run", longer, stated)
    assert [str(change) for change in changes] == ["train.epochs: 1 in the run, 3 now"]
    assert plan.train.epochs == 3 and plan.optimizer.lr == 0.5 and plan.output.checkpoint_every_steps == 20
    with pytest.raises(InputError) as refused:
        continued_plan(tmp_path / "run", longer, [*stated, "optimizer.lr", "model.input_shape"])
    line = str(refused.value)
    assert line.startswith("--resume: optimizer.lr: 0.5 in the run, 0.003 now; only the output section")
    assert "\n" not in line and "input_shape" not in line  # unchanged fields are not named
    narrower = load_plan(
        tmp_path / "gpt.toml", ["model.layers=[{type='embedding', vocab_size=32, units=32}]"]
    )
    with pytest.raises(InputError, match=r"model\.layers: 5 entries in the run, 1 entry now"):
        continued_plan(tmp_path / "run", narrower, None)  # None: every field stated (a Python plan)


def test_the_launch_layout_is_kept_read_back_and_replaced_by_overwrite(tmp_path: Path) -> None:
    """launch.json: the layout a bare --resume continues on; a folder written before it
    existed reads as None; a damaged one names itself; --overwrite removes it."""
    from crosstrain.core.admission.runfolder import LAUNCH_FILE, read_launch_record, write_launch_record
    from crosstrain.core.run.job import Layout

    run = tmp_path / "run"
    run.mkdir()
    assert read_launch_record(run) is None
    layout = Layout("tf", 2, workers=2, nnodes=1, device="cpu")
    write_launch_record(run, layout)
    assert read_launch_record(run) == layout
    (run / LAUNCH_FILE).write_text(
        '{"backend": "tf", "nproc": 0, "workers": null, "nnodes": 1, "device": "cpu"}'
    )
    with pytest.raises(
        RunFolderError, match=r"launch\.json: not a crosstrain launch record \(0 is not a count\)"
    ):
        read_launch_record(run)
    (run / LAUNCH_FILE).write_text('{"backend": "tf"}')
    with pytest.raises(RunFolderError, match=r"launch\.json: not a crosstrain launch record \(no 'nproc'\)"):
        read_launch_record(run)
    with open_run_folder(run, overwrite=True):
        assert not (run / LAUNCH_FILE).exists()
