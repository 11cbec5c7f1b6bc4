"""Checkpoints, resume, stop requests and non-finite losses, through the loop, against a
numpy backend (:class:`crosstrain.testing.null.MomentumStrategy`) whose state (a weight, a
momentum slot, a step count) depends on every batch it saw and in which order: a resumed
run equals an uninterrupted one only if the weights, the slot, the count and the
sampler's position all come back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from crosstrain.core.errors import BackendError, CheckpointError
from crosstrain.core.run.checkpoint import (
    MANIFEST_FILE,
    TensorFile,
    check_written_by,
    choose_checkpoint,
    complete_checkpoints,
    last_checkpoint,
    load_checkpoint,
    plan_hash,
    read_checkpoint,
)
from crosstrain.core.run.job import Job, LaunchOptions, Layout
from crosstrain.core.run.loop import train
from crosstrain.core.run.resume import check_backend_supports
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing import step_losses
from crosstrain.testing.null import MomentumStrategy
from crosstrain.testing.runs import summary as summary_of
from tests.conftest import MLP_PLAN, InProcessCli
from tests.support import StepRecorder

NULL = ("-p", "crosstrain.testing.null", "-p", "no:progress")

SETTINGS = [
    "train.epochs=2",
    "train.max_steps=60",  # 45 steps an epoch: the run crosses into the second
    "output.checkpoint_every_steps=20",
    "output.log_every_steps=5",
    "optimizer.name='sgd'",
    "schedule.name='cosine'",
]


def _job(write_plan: Callable[..., Path], out: Path, *settings: str, resume: bool = False) -> Job:
    plan = load_plan(write_plan(), [*SETTINGS, *settings])
    return Job(plan=plan, layout=Layout("numpy", 1), launch=LaunchOptions(resume=resume), out_dir=str(out))


def _run(
    strategy: MomentumStrategy, job: Job, recorder: StepRecorder | None = None
) -> tuple[Any, Any, StepRecorder]:
    recorder = recorder or StepRecorder()
    summary, state = train(strategy, job, recorder)  # type: ignore[arg-type]
    return summary, state, recorder


def test_a_resumed_run_equals_an_uninterrupted_one(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    whole, whole_state, whole_steps = _run(MomentumStrategy(), _job(write_plan, tmp_path / "whole"))
    broken = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="failed at step 45"):
        _run(MomentumStrategy(fail_at=45), _job(write_plan, broken))
    assert [step for step, _ in complete_checkpoints(broken)] == [20, 40]
    resumed, state, steps = _run(MomentumStrategy(), _job(write_plan, broken, resume=True))
    assert steps.steps == whole_steps.steps[40:]  # steps 41-60, mid-epoch on, bit for bit
    assert np.array_equal(state["w"], whole_state["w"]) and state["steps"] == whole_state["steps"] == 60
    assert resumed["train"] == whole["train"] and resumed["eval"] == whole["eval"]
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == 60


def test_checkpoint_folders_hold_the_loop_state_and_are_pruned(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    _run(MomentumStrategy(), _job(write_plan, tmp_path, "output.keep_checkpoints=2"))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [40, 60]  # 20 pruned; 60: the end
    saved = read_checkpoint(tmp_path / "checkpoints" / "step-00000040")
    assert (saved.state.step, saved.state.epoch, saved.state.step_in_epoch) == (40, 0, 40)
    assert saved.optimizer["optimizer.step"] == 40 and "optimizer.w.momentum" in saved.optimizer
    assert saved.state.backend == "numpy" and len(saved.state.plan_hash) == 16
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporaries


def test_a_checkpoint_is_read_a_tensor_at_a_time(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    """A resumed run's checkpoint: each tensor read from its file when it is looked up (so
    a rank holds one whole tensor of it at a time), its header at once (so a file that
    does not read is refused before any tensor is looked up)."""
    _run(MomentumStrategy(), _job(write_plan, tmp_path))
    folder = tmp_path / "checkpoints" / "step-00000040"
    saved, whole = read_checkpoint(folder), load_checkpoint(folder / "model.safetensors")
    assert list(saved.weights) == list(whole) and "optimizer.w.momentum" in saved.optimizer
    save_file({name: value + 1 for name, value in whole.items()}, str(folder / "model.safetensors"))
    assert all(np.array_equal(saved.weights[name], value + 1) for name, value in whole.items())
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot be read as safetensors"):
        TensorFile(folder / "model.safetensors")


def test_a_torn_checkpoint_is_not_resumed_from(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        _run(MomentumStrategy(fail_at=45), _job(write_plan, tmp_path))
    torn = tmp_path / "checkpoints" / ".step-00000044.tmp"  # a crash mid-write leaves this
    torn.mkdir()
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000040"


def test_resuming_another_plan_is_refused(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    _run(MomentumStrategy(), _job(write_plan, tmp_path))
    with pytest.raises(CheckpointError, match="written by another plan"):
        _run(MomentumStrategy(), _job(write_plan, tmp_path, "optimizer.lr=0.5", resume=True))


def test_keep_best_keeps_the_best_evaluation(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    settings = (
        "train.epochs=4",
        "train.max_steps=180",
        "output.keep_checkpoints=1",
        "output.keep_best='eval.loss'",
    )
    _run(MomentumStrategy(), _job(write_plan, tmp_path, *settings))
    kept = complete_checkpoints(tmp_path)
    evals = [json.loads(p.read_text()) for p in [path / "state.json" for _, path in kept]]
    assert len(kept) == 2 and kept[-1][0] == 180
    best = min(evals, key=lambda state: state["eval"]["loss"])
    assert best["eval_step"] == best["step"]  # evaluated at its own step


def test_a_plugin_stops_the_run_normally(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    summary, _, recorder = _run(MomentumStrategy(), _job(write_plan, tmp_path), StepRecorder(stop_at=12))
    # asked at step 12 (read in the chunk of steps 11-15): the ranks agree after that chunk
    assert summary["stopped"] == {"kind": "requested", "reason": "enough", "step": 15}
    assert summary["steps"] == 15 and recorder.steps[-1][0] == 15
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [15]  # the end checkpoint


def test_a_non_finite_loss_stops_at_its_step(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    summary, _, recorder = _run(MomentumStrategy(nan_at=27), _job(write_plan, tmp_path))
    assert summary["stopped"]["kind"] == "nonfinite" and summary["stopped"]["step"] == 27
    assert "non-finite loss (nan) at step 27" in summary["stopped"]["reason"]
    assert recorder.steps[-1][0] == 27  # steps 28-30 ran in its chunk but are not logged
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [20]  # the last good one
    assert not (tmp_path / "model.safetensors").exists()  # no NaN model saved


def test_what_a_backend_cannot_do_is_refused_before_launch(
    write_plan: Callable[..., Path],
) -> None:
    class NoOptimizerState:
        name = "bare"

    plan = load_plan(write_plan(), ["output.checkpoint_every_steps=10"])
    with pytest.raises(BackendError, match=r"output\.checkpoint_every_steps: the bare backend cannot save"):
        check_backend_supports(NoOptimizerState(), plan, "bare")  # type: ignore[arg-type]
    skip = load_plan(write_plan(), ["train.on_nonfinite='skip'"])
    with pytest.raises(BackendError, match=r"train\.on_nonfinite = 'skip': the bare backend cannot skip"):
        check_backend_supports(NoOptimizerState(), skip, "bare")  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="--max-restarts: the bare backend cannot restart"):
        check_backend_supports(NoOptimizerState(), load_plan(write_plan()), "bare", 1)  # type: ignore[arg-type]
    placed = load_plan(write_plan(), ["data.placement='device'"])
    with pytest.raises(BackendError, match=r"data\.placement = 'device': the bare backend keeps the data"):
        check_backend_supports(NoOptimizerState(), placed, "bare")  # type: ignore[arg-type]
    check_backend_supports(NoOptimizerState(), load_plan(write_plan(), ["data.placement='host'"]), "bare")  # type: ignore[arg-type]


def test_checkpoints_are_verified_against_their_manifest(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """The newest checkpoint that verifies is chosen, each newer one named with its damaged
    file; a format-1 checkpoint (no manifest) counts as intact when its files read whole."""
    job = _job(write_plan, tmp_path)
    _run(MomentumStrategy(), job)
    twenty, forty, sixty = (path for _, path in complete_checkpoints(tmp_path))
    assert choose_checkpoint(tmp_path).path == sixty and not choose_checkpoint(tmp_path).damaged
    model = sixty / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-1] + b"\x01")  # the same size, another byte
    (forty / "optimizer.safetensors").write_bytes((forty / "optimizer.safetensors").read_bytes()[:40])
    choice = choose_checkpoint(tmp_path)
    assert choice.path == twenty
    assert [problem for _, problem in choice.damaged] == [
        f"{model} is damaged (its sha256 differs from its manifest's)",
        f"{forty / 'optimizer.safetensors'} is damaged (40 bytes, its manifest says "
        f"{json.loads((forty / MANIFEST_FILE).read_text())['files']['optimizer.safetensors']['size']})",
    ]
    # format 1: no manifest, and a plan hash that includes the run's length
    (twenty / MANIFEST_FILE).unlink()
    state = json.loads((twenty / "state.json").read_text())
    legacy = {**state, "format": 1, "plan_hash": plan_hash(job.plan, with_length=True)}
    (twenty / "state.json").write_text(json.dumps(legacy))
    assert choose_checkpoint(tmp_path).path == twenty
    check_written_by(twenty, job.plan)
    longer = _job(write_plan, tmp_path, "train.max_steps=80").plan
    with pytest.raises(CheckpointError, match="only the output section may change"):
        check_written_by(twenty, longer)  # a format-1 checkpoint continues only to its own end
    (twenty / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*: .*step-00000060/model"):
        choose_checkpoint(tmp_path)


def test_a_run_continues_with_its_own_plan_to_a_new_end(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """`run --out DIR --resume --set train.max_steps=60` on a finished 30-step run started
    with overrides: the run's own plan (no plan file, nothing retyped) continues to the new
    end through the same steps and checkpoints as an uninterrupted 60-step run."""
    plan = str(write_plan())
    started = ["--set", "train.epochs=2", "--set", "output.checkpoint_every_steps=10"]
    started += ["--set", "output.log_every_steps=1", "--set", "output.keep_checkpoints=10"]

    def run(*arguments: str) -> str:
        result = cli_in_process(*NULL, "run", *arguments, "--backend", "momentum")
        assert result.returncode == 0, result.stderr
        return result.stderr

    run(plan, "--out", str(tmp_path / "whole"), *started, "--set", "train.max_steps=60")
    run(plan, "--out", str(tmp_path / "run"), *started, "--set", "train.max_steps=30")
    assert run("--out", str(tmp_path / "run"), "--resume", "--set", "train.max_steps=60") == ""
    assert list(step_losses(tmp_path / "run")) == list(step_losses(tmp_path / "whole"))
    steps = [step for step, _ in complete_checkpoints(tmp_path / "run")]
    assert steps == [step for step, _ in complete_checkpoints(tmp_path / "whole")] == list(range(10, 61, 10))


def test_what_cannot_continue_is_refused_in_one_line(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """No plan and no --resume; a run that kept no checkpoints (--init-from is the way on);
    a cosine schedule continued to a new length says its curve follows the new length."""

    def run(*arguments: str) -> Any:
        return cli_in_process(*NULL, "run", *arguments, "--backend", "momentum")

    plan = str(write_plan())
    refused = run("--out", str(tmp_path / "nothing"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("crosstrain: error: run: no plan file; crosstrain run PLAN starts")
    assert run(plan, "--out", str(tmp_path / "bare")).returncode == 0
    refused = run("--out", str(tmp_path / "bare"), "--resume", "--set", "train.epochs=2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"--init-from {tmp_path / 'bare'} starts a new run from its weights" in refused.stderr
    cosine = ("--set", "schedule.name='cosine'", "--set", "output.checkpoint_every_steps=20")
    assert run(plan, "--out", str(tmp_path / "cosine"), *cosine).returncode == 0
    continued = run("--out", str(tmp_path / "cosine"), "--resume", "--set", "train.epochs=2")
    assert continued.returncode == 0, continued.stderr
    assert continued.stderr.splitlines() == [
        "crosstrain: schedule.name = 'cosine' depends on the run's length: after the checkpoint the "
        "learning rate follows the curve of the new length (train.epochs: 1 in the run, 2 now)"
    ]


def test_fit_starts_a_new_run_from_another_run_s_weights(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """``crosstrain.fit(..., init_from=RUN_DIR)``: the run's final weights (the null backend
    keeps the plan's, under their real names), a step-0 evaluation first, the source named
    in plan.json."""
    from crosstrain.api import fit
    from crosstrain.core.run.job import PluginSelection

    plugins = PluginSelection(enabled=("crosstrain.testing.null",), disabled=("progress",))
    plan = write_plan()
    fit(plan, backend="null", out=tmp_path / "source", plugins=plugins)
    started = fit(plan, backend="null", out=tmp_path / "new", plugins=plugins, init_from=tmp_path / "source")
    records = [json.loads(line) for line in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"step": 0, "epoch": 0, "eval": records[0]["eval"]} and "loss" in records[1]
    assert started["steps"] == 45 and started["resumed_from_step"] is None
    plan_json = json.loads((tmp_path / "new" / "plan.json").read_text())
    assert plan_json["init_from"] == str(tmp_path / "source" / "model.safetensors")


# --------------------------------------------------------------------------- layout and length


def _header(stdout: str) -> str:
    """The progress plugin's first line (in a pipe: plain lines)."""
    return stdout.splitlines()[0]


def test_a_bare_resume_continues_on_the_run_s_own_layout_and_a_flag_overrides_it(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """A momentum x2 run on --device cpu, continued by a bare ``--resume``: its launch.json
    gives the backend, the world and the device (its header says "as run"), and it takes an
    uninterrupted x2 run's steps; ``--nproc 1`` then overrides the world alone, and the
    header names what it was."""
    plan = str(write_plan(MLP_PLAN.replace("epochs = 1\n", "")))  # max_steps alone: epochs unbounded
    launch = ["--backend", "momentum", "--nproc", "2", "--device", "cpu"]
    started = ["--set", "output.checkpoint_every_steps=10"]

    def run(*arguments: str) -> Any:
        result = cli_in_process("-p", "crosstrain.testing.null", "run", *arguments)
        assert result.returncode == 0, result.stderr
        return result

    run(plan, "--out", str(tmp_path / "whole"), *launch, *started, "--set", "train.max_steps=60")
    run(plan, "--out", str(tmp_path / "run"), *launch, *started, "--set", "train.max_steps=30")
    resumed = run("--out", str(tmp_path / "run"), "--resume", "--set", "train.max_steps=60")
    assert (
        _header(resumed.stdout)
        == "tiny_mlp (seed 3): 60 steps (max_steps; 1.3 epochs) on momentum x2, resumed at step 30 as run"
    )
    assert summary_of(tmp_path / "run")["world_size"] == 2
    assert list(step_losses(tmp_path / "run")) == list(step_losses(tmp_path / "whole"))
    resumed = run("--out", str(tmp_path / "run"), "--resume", "--set", "train.max_steps=70", "--nproc", "1")
    assert _header(resumed.stdout).endswith("on momentum x1, resumed at step 60 (was momentum x2)")
    assert summary_of(tmp_path / "run")["world_size"] == 1
    launched = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert launched == {"backend": "momentum", "nproc": 1, "workers": None, "nnodes": 1, "device": "cpu"}


def test_fit_resumes_on_the_run_s_own_layout(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    """``crosstrain.fit(None, out=RUN, resume=True)`` leaves backend, nproc and device to
    the run, as the CLI's bare --resume does; a keyword given overrides its part."""
    from crosstrain.api import fit
    from crosstrain.core.run.job import PluginSelection

    plugins = PluginSelection(enabled=("crosstrain.testing.null",), disabled=("progress",))
    out = tmp_path / "run"
    started = ["output.checkpoint_every_steps=10", "train.max_steps=20"]
    fit(write_plan(), backend="momentum", nproc=2, device="cpu", out=out, plugins=plugins, overrides=started)
    resumed = fit(None, out=out, resume=True, plugins=plugins, overrides=["train.max_steps=30"])
    assert (resumed["backend"], resumed["world_size"], resumed["steps"]) == ("momentum", 2, 30)
    resumed = fit(None, "null", out=out, resume=True, plugins=plugins, overrides=["train.max_steps=40"])
    assert (resumed["backend"], resumed["world_size"]) == ("null", 2)


def test_a_folder_that_records_no_layout_resumes_on_the_flags_and_defaults(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """A run folder written before runs kept launch.json: the flags given and the defaults
    apply (here one replica, not the run's two), and the header says so."""
    plan, out = str(write_plan()), str(tmp_path / "run")
    null = ("-p", "crosstrain.testing.null")
    started = ("--set", "output.checkpoint_every_steps=10", "--set", "train.max_steps=20")
    assert (
        cli_in_process(
            *null, "run", plan, "--out", out, "--backend", "momentum", "--nproc", "2", *started
        ).returncode
        == 0
    )
    (tmp_path / "run" / "launch.json").unlink()
    resumed = cli_in_process(
        *null, "run", "--out", out, "--resume", "--backend", "momentum", "--set", "train.max_steps=30"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert _header(resumed.stdout).endswith(
        "on momentum x1, resumed at step 20 (its folder records no layout: the flags and defaults apply)"
    )


def test_max_steps_past_the_epochs_end_extends_a_run_without_epochs_or_is_refused_naming_them(
    write_plan: Callable[..., Path], tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    """A finished run of ``train.epochs = 1`` (45 steps): a bare --resume is refused offering
    train.epochs, the one field that moves its end; ``train.max_steps=100`` alone would stop
    at step 45, so it is refused in one line that names train.epochs; with train.epochs=3 it
    runs to step 100. The same plan without train.epochs is extended by max_steps alone."""

    def run(*arguments: str) -> Any:
        return cli_in_process(*NULL, "run", *arguments, "--backend", "momentum")

    every = ("--set", "output.checkpoint_every_steps=20")
    out = str(tmp_path / "epochs")
    assert run(str(write_plan()), "--out", out, *every).returncode == 0
    refused = run("--out", out, "--resume")
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "crosstrain: error: --resume: the run already ended at step 45 (train.epochs = 1); "
        "--set train.epochs=N continues it to a new end"
    ]
    refused = run("--out", out, "--resume", "--set", "train.max_steps=100")
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "crosstrain: error: --resume: train.max_steps = 100 lies past the end of train.epochs = 1 "
        "(step 45), which would stop the run first; --set train.epochs=3 too reaches step 100"
    ]
    continued = run("--out", out, "--resume", "--set", "train.max_steps=100", "--set", "train.epochs=3")
    assert continued.returncode == 0, continued.stderr
    assert summary_of(tmp_path / "epochs")["steps"] == 100
    unbounded, out = write_plan(MLP_PLAN.replace("epochs = 1\n", ""), "unbounded.toml"), str(tmp_path / "max")
    assert run(str(unbounded), "--out", out, *every).returncode == 0  # neither set: one epoch
    assert run("--out", out, "--resume", "--set", "train.max_steps=100").returncode == 0
    assert summary_of(tmp_path / "max")["steps"] == 100
