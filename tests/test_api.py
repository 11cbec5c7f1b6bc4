"""crosstrain.api: a launch's layout, resolved once from the flags given, a resumed run's
own (its run folder's launch.json) and the defaults; the job that holds the launch record
and what was resolved on top."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import attrs
import pytest

from crosstrain.api import make_job, prepare_plan, resolve_layout
from crosstrain.core.admission.cluster import ThisMachine
from crosstrain.core.run.job import LaunchOptions, Layout

RAN = Layout("tf", 2, workers=2, nnodes=1, device="cpu")
RESUMED = LaunchOptions(resume=True)


@attrs.frozen
class OutsideLauncher:
    """torchrun or srun: it started ``processes`` processes, this one among them."""

    processes: int = 4
    starts_processes: bool = False

    def world_size(self) -> int:
        return self.processes

    def rank(self) -> int:
        return 0

    def describe(self) -> str:
        return f"the test launcher ({self.processes} processes)"


def test_a_new_run_takes_the_flags_and_the_defaults() -> None:
    assert resolve_layout(LaunchOptions(), None, ThisMachine()) == Layout("torch", 1)
    assert resolve_layout(LaunchOptions(resume=False), RAN, ThisMachine()) == Layout("torch", 1)
    given = LaunchOptions(backend="tf", replicas=2, device="gpu", nnodes=2)
    assert resolve_layout(given, None, ThisMachine()) == Layout("tf", 2, None, 2, "gpu")


def test_a_resumed_run_takes_its_own_layout_and_each_flag_overrides_its_part() -> None:
    assert resolve_layout(RESUMED, RAN, ThisMachine()) == RAN
    on_gpu = attrs.evolve(RESUMED, device="gpu")
    assert resolve_layout(on_gpu, RAN, ThisMachine()) == attrs.evolve(RAN, device="gpu")
    # a folder written before launch.json: the defaults, as for a new run
    assert resolve_layout(RESUMED, None, ThisMachine()) == Layout("torch", 1)


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        ({"backend": "torch"}, Layout("torch", 2, None, 1, "cpu")),
        ({"replicas": 4}, Layout("tf", 4, None, 1, "cpu")),
        ({"workers": 1}, Layout("tf", 2, 1, 1, "cpu")),
    ],
)
def test_the_run_s_workers_follow_only_its_backend_and_world(
    changed: dict[str, object], expected: Layout
) -> None:
    """--workers splits the replicas into one backend's processes: another backend or world
    takes the natural layout, not the run's split of its own."""
    assert resolve_layout(attrs.evolve(RESUMED, **changed), RAN, ThisMachine()) == expected


def test_under_an_outside_launcher_its_processes_make_the_world_of_a_resumed_run() -> None:
    ran = Layout("torch", 2, device="cpu")
    assert resolve_layout(RESUMED, ran, OutsideLauncher(4)) == Layout("torch", 4, None, 1, "cpu")


def test_a_job_holds_what_was_asked_and_what_was_resolved_and_pickles_whole(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """The job every worker receives: the launch record as given (its layout left None), the
    layout resolved on top, the run folder made absolute."""
    asked = LaunchOptions(
        device="cpu", out=tmp_path / "run", options=MappingProxyType({"patience": 5}), timeout_seconds=7.0
    )
    job = make_job(prepare_plan(write_plan()), asked, ThisMachine())
    assert job.launch.backend is None and job.launch.replicas is None
    assert job.layout == Layout("torch", 1, None, 1, "cpu")
    assert (job.backend, job.replicas, job.device) == ("torch", 1, "cpu")
    assert job.out_dir == str((tmp_path / "run").resolve())
    sent = pickle.loads(pickle.dumps(job))
    assert sent == job
    assert sent.launch.options == {"patience": 5} and sent.launch.timeout_seconds == 7.0
