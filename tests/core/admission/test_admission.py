"""The admission step in process, on the null backend: what it refuses, in which order
(a job with two problems is refused for the earlier one), and that it writes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest
from safetensors.numpy import save_file

from crosstrain.core.admission.checks import admit, starting_weights_source
from crosstrain.core.errors import BackendError, CheckpointError, InputError, PlanError, RunFolderError
from crosstrain.core.run.checkpoint import LoopState, plan_hash, write_checkpoint
from crosstrain.core.run.job import Job, LaunchOptions, Layout
from crosstrain.core.run.strategy import FrameworkStatus
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, Vocabulary
from crosstrain.testing.null import NullStrategy


class WithoutRelu(NullStrategy):
    """Speaks every core name but ``relu`` (the test plan's second layer)."""

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        return attrs.evolve(CORE_VOCABULARY, layers=CORE_VOCABULARY.layers - {"relu"})


class RefusesEveryJob(WithoutRelu):
    def check_job(self, job: Job) -> None:
        raise BackendError("the null backend refuses this layout")


class NotInstalled(RefusesEveryJob):
    install_hint: ClassVar[str] = "pip install nothing"

    @classmethod
    def framework_status(cls) -> FrameworkStatus:
        return FrameworkStatus(importable=False, problem="No module named 'nothing'")


class Spanning(NullStrategy):
    """Runs under outside launchers (:class:`~crosstrain.core.run.strategy.SpansNodes`)."""

    def spans_nodes(self) -> bool:
        return True


@attrs.frozen
class OutsideLauncher:
    """An outside launcher's group of ``processes``, this process being ``this_rank``."""

    processes: int = 4
    this_rank: int = 0
    starts_processes: bool = False

    def world_size(self) -> int:
        return self.processes

    def rank(self) -> int:
        return self.this_rank

    def describe(self) -> str:
        return f"the test launcher ({self.processes} processes)"


@pytest.fixture
def make_job(write_plan: Callable[..., Path], tmp_path: Path) -> Callable[..., Job]:
    """A job of the tiny MLP plan (global batch 32) into tmp_path/run, fields overridden: the
    job's own, else its layout's, else the launch record's."""
    plan_file = write_plan()

    def make(*settings: str, **fields: Any) -> Job:
        job = Job(
            plan=load_plan(plan_file, settings), layout=Layout("null", 1), out_dir=str(tmp_path / "run")
        )
        own = {name: fields.pop(name) for name in attrs.fields_dict(Job) if name in fields}
        layout = {name: fields.pop(name) for name in attrs.fields_dict(Layout) if name in fields}
        return attrs.evolve(
            job, layout=attrs.evolve(job.layout, **layout), launch=LaunchOptions(**fields), **own
        )

    return make


def test_a_job_that_fits_is_admitted_and_nothing_is_written(
    make_job: Callable[..., Job], tmp_path: Path
) -> None:
    admit(make_job(replicas=2), NullStrategy())
    assert not (tmp_path / "run").exists()  # the run folder makes it, once admitted


@pytest.mark.parametrize(
    ("strategy", "settings", "fields", "error", "message"),
    [
        # 1, the framework, before 2, the cluster flags
        (NotInstalled(), (), {"nnodes": 0}, BackendError, "install it with: pip install nothing"),
        # 2, the cluster, before 3, the numbers
        (NullStrategy(), (), {"nnodes": 2, "timeout_seconds": 0.0}, InputError, "--nnodes 2 needs"),
        # 3, the numbers, before 4, the plan against the world
        (NullStrategy(), (), {"replicas": 3, "timeout_seconds": 0.0}, InputError, "--timeout 0: must be"),
        (NullStrategy(), (), {"replicas": 3, "resume": True, "init_from": "FILE"}, InputError, "exclude"),
        # 4, the world, before 6, the backend's tables
        (WithoutRelu(), (), {"replicas": 3}, PlanError, r"32 is not divisible by replicas \(3\)"),
        # 5, the data, before 6, the backend's tables
        (WithoutRelu(), ("model.input_shape=[32]",), {}, PlanError, r"rows have shape \[64\]"),
        # 6, the backend's tables, before 7, its own check
        (RefusesEveryJob(), (), {}, PlanError, r"model.layers\[1\]: the null backend has no 'relu'"),
        # 7, the backend's own check, before 8, its capabilities
        (
            RefusesEveryJob(),
            ("model.layers=[{type='dense', units=10}]",),
            {"max_restarts": 1},
            BackendError,
            "refuses this layout",
        ),
        # 8, the capabilities, before 9, the output folder
        (NullStrategy(), (), {"max_restarts": 1, "out_dir": "FILE"}, BackendError, "cannot restart"),
        # 9, the output folder, before 10, the weights to start from
        (NullStrategy(), (), {"init_from": "FILE", "out_dir": "FILE"}, InputError, "is a file, not a folder"),
    ],
)
def test_of_two_problems_the_earlier_step_is_reported(
    make_job: Callable[..., Job],
    tmp_path: Path,
    strategy: NullStrategy,
    settings: tuple[str, ...],
    fields: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    file = tmp_path / "file"
    file.write_text("not a folder")
    fields = {key: str(file) if value == "FILE" else value for key, value in fields.items()}
    with pytest.raises(error, match=message):
        admit(make_job(*settings, **fields), strategy)
    assert not (tmp_path / "run").exists()


def test_the_output_folder_is_checked_without_creating_it(
    make_job: Callable[..., Job], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(InputError, match="cannot create the folder: Not a directory"):
        admit(make_job(out_dir=str(tmp_path / "file" / "run")), NullStrategy())
    admit(make_job(out_dir=str(tmp_path / "new" / "deeper" / "run")), NullStrategy())
    assert not (tmp_path / "new").exists()


def test_a_resumed_run_needs_its_folder_and_a_checkpoint_of_this_plan(
    make_job: Callable[..., Job], tmp_path: Path
) -> None:
    job = make_job(resume=True)
    with pytest.raises(RunFolderError, match="--resume: no run folder"):
        admit(job, NullStrategy())
    (tmp_path / "run").mkdir()
    with pytest.raises(RunFolderError, match="has no complete checkpoint"):
        admit(job, NullStrategy())
    with pytest.raises(RunFolderError, match="--resume and --overwrite exclude each other"):
        admit(job, NullStrategy(), overwrite=True)
    state = LoopState(step=10, epoch=0, step_in_epoch=10, backend="null", plan_hash="another plan's")
    write_checkpoint(tmp_path / "run", state, {}, {})
    with pytest.raises(CheckpointError, match="written by another plan"):
        admit(job, NullStrategy())
    mine = attrs.evolve(state, plan_hash=plan_hash(job.plan))
    write_checkpoint(tmp_path / "run", mine, {}, {})
    admitted = admit(job, NullStrategy())  # the checkpoint the workers read, chosen once
    assert admitted.resume_from == str(tmp_path / "run" / "checkpoints" / "step-00000010")
    finished = attrs.evolve(mine, step=45, step_in_epoch=0, epoch=1)  # the plan's 45 steps, done
    write_checkpoint(tmp_path / "run", finished, {}, {})
    with pytest.raises(InputError, match=r"the run already ended at step 45 .* --set train\.epochs=N"):
        admit(job, NullStrategy())


def test_a_new_run_starts_only_from_weights_that_fit_its_model(
    make_job: Callable[..., Job], tmp_path: Path
) -> None:
    """--init-from: a run folder's final weights, name by name and shape by shape against
    the plan's model; the first that does not fit is named."""
    source = tmp_path / "source"
    source.mkdir()
    weights = make_job().plan.model.graph().init_weights(0)
    save_file(weights, str(source / "model.safetensors"))
    admitted = admit(make_job(init_from=str(source)), NullStrategy())
    assert admitted.init_from == str(source / "model.safetensors")
    narrow = make_job("model.layers=[{type='dense', units=16}, {type='relu'}, {type='dense', units=10}]")
    with pytest.raises(
        InputError, match=r"weight 'dense_0.kernel' has shape \[64, 32\], the plan's model needs \[64, 16\]"
    ):
        admit(attrs.evolve(narrow, init_from=str(source)), NullStrategy())
    save_file({"other": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(InputError, match=r"has no weight 'dense_0\.kernel'"):
        admit(make_job(init_from=str(tmp_path / "other.safetensors")), NullStrategy())
    (tmp_path / "cut.safetensors").write_bytes((source / "model.safetensors").read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: cannot be read as safetensors"):
        admit(make_job(init_from=str(tmp_path / "cut.safetensors")), NullStrategy())
    assert not (tmp_path / "run").exists()


def test_the_plan_s_model_init_is_checked_as_init_from_is_and_the_flag_replaces_it(
    make_job: Callable[..., Job], tmp_path: Path
) -> None:
    """``model.init`` (relative to the plan file) is admitted as ``--init-from``'s weights
    are, its errors naming the plan's field; ``--init-from`` replaces it, saying so; a
    resumed run reads neither (its checkpoint holds the weights)."""
    weights = make_job().plan.model.graph().init_weights(0)
    save_file(weights, str(tmp_path / "init.safetensors"))
    job = make_job("model.init='init.safetensors'")
    assert job.plan.model.init == str(tmp_path / "init.safetensors")  # beside the plan file
    assert admit(job, NullStrategy()).init_from == str(tmp_path / "init.safetensors")
    missing = make_job("model.init='gone.safetensors'")
    with pytest.raises(
        CheckpointError,
        match=rf"^{tmp_path / 'plan.toml'}: model.init = {tmp_path / 'gone.safetensors'}: no such",
    ):
        admit(missing, NullStrategy())
    narrow = make_job(
        "model.layers=[{type='dense', units=16}, {type='relu'}, {type='dense', units=10}]",
        "model.init='init.safetensors'",
    )
    with pytest.raises(InputError, match=r"plan\.toml: model\.init = .*weight 'dense_0\.kernel' has shape"):
        admit(narrow, NullStrategy())
    save_file(weights, str(tmp_path / "other.safetensors"))
    notes: list[str] = []
    flagged = admit(
        attrs.evolve(missing, init_from=str(tmp_path / "other.safetensors")), NullStrategy(), say=notes.append
    )
    assert flagged.init_from == str(tmp_path / "other.safetensors")
    assert notes == [
        f"--init-from {tmp_path / 'other.safetensors'} replaces the plan's model.init "
        f"({tmp_path / 'gone.safetensors'})"
    ]
    assert starting_weights_source(attrs.evolve(missing, launch=LaunchOptions(resume=True))) is None
    assert not (tmp_path / "run").exists()


def test_under_an_outside_launcher_the_flags_meet_its_processes(make_job: Callable[..., Job]) -> None:
    admit(make_job(replicas=4), Spanning(), OutsideLauncher())
    with pytest.raises(InputError, match=r"--nproc 2, but the test launcher \(4 processes\)"):
        admit(make_job(replicas=2), Spanning(), OutsideLauncher())
    with pytest.raises(BackendError, match="the null backend runs on one machine in one launch"):
        admit(make_job(replicas=4), NullStrategy(), OutsideLauncher())


def test_only_the_rank_that_minds_the_run_folder_checks_a_resumed_run(make_job: Callable[..., Job]) -> None:
    job = make_job(replicas=4, resume=True)  # no run folder here: another machine's, maybe
    admit(job, Spanning(), OutsideLauncher(this_rank=1))
    with pytest.raises(RunFolderError, match="no run folder"):
        admit(job, Spanning(), OutsideLauncher(this_rank=0))


def test_a_model_without_trainable_weights_is_refused_naming_its_layers(tmp_path: Path) -> None:
    plan_file = tmp_path / "weightless.toml"
    plan_file.write_text(
        'metrics = ["loss"]\n[model]\ninput_shape = [64]\n'
        'layers = [{ type = "relu" }, { type = "reshape", target_shape = [64, 1] }, '
        '{ type = "mean", axes = [0] }]\n[loss]\nname = "mse"\n'
    )
    job = Job(plan=load_plan(plan_file), layout=Layout("null", 1), out_dir=str(tmp_path / "run"))
    with pytest.raises(PlanError, match=r"model.layers: the model has no trainable weights"):
        admit(job, NullStrategy())
    assert not (tmp_path / "run").exists()
