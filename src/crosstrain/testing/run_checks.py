"""What the conformance suites share: the tolerances their comparisons use, and the
checks that run the real CLI and read the runs it writes (a run killed then resumed from its
folder alone, a new run started from a finished run's weights, the plans a backend speaks)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from crosstrain.core.admission.runfolder import read_launch_record
from crosstrain.core.errors import PlanError
from crosstrain.core.run.checkpoint import complete_checkpoints
from crosstrain.core.run.job import Layout
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import (
    SpeaksVocabulary,
    check_plan_vocabulary,
)
from crosstrain.plugins.manager import get_backend, make_plugin_manager
from crosstrain.testing.launches import (
    PLAN_SETTINGS,
    PLANS,
    STEPS,
    run_cli,
    write_plan,
)
from crosstrain.testing.runs import summary

#: relative per-step loss differences: same backend at another world size, and across frameworks
WORLD_TOLERANCE = 1e-5
PARITY_TOLERANCE = 1e-4
#: the traceback files torch.multiprocessing writes for each worker, which a failed run must
#: not leave behind in the temporary folder
TRACEBACK_FILES = "pytorch-errorfile-*"
#: the resume checks: checkpoints every CHECKPOINT_EVERY steps, a rank dies at FAIL_STEP
CHECKPOINT_EVERY, FAIL_STEP = 5, 8
RESUME_SETTINGS = (
    "--set", f"output.checkpoint_every_steps={CHECKPOINT_EVERY}",
    "--set", "output.log_every_steps=4",  # the failing hook runs when step FAIL_STEP is read
)  # fmt: skip


def assert_failed_naming_the_rank(result: subprocess.CompletedProcess[str], error: str) -> None:
    """A run a rank failed: exit 1, the failing rank's traceback once (none from its peers or
    the launcher), and last one line naming the rank and its error."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.stderr[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("crosstrain: error: rank ") and last.endswith(error), result.stderr[-3000:]


def fail_then_resume(
    backend: str,
    plan: Path,
    out: Path,
    nproc: int,
    resume_backend: str | None = None,
    settings: Sequence[str] = (),
) -> Path:
    """Train ``plan`` (with the ``--set`` ``settings``) for STEPS steps with checkpoints; a
    rank dies at FAIL_STEP; then ``--resume`` finishes the run from the run folder alone: no
    plan file, none of the run's ``--set`` overrides or layout flags typed again
    (``--backend resume_backend`` alone, when given, overrides its backend), so it continues
    on the run's own world and device. Its checkpoints are then those of a run never
    interrupted. The failed run leaves no worker's traceback file in its temporary folder."""
    common = ("--nproc", str(nproc), "--device", "cpu", "--out", str(out))
    temporary = out.with_name(f"{out.name}-tmp")
    temporary.mkdir(parents=True)
    failed = run_cli(
        "-p", "no:progress", "-p", "crosstrain.testing.faults", "run", str(plan), "--backend", backend,
        *common, "--set", f"train.max_steps={STEPS}", *RESUME_SETTINGS,
        *(item for setting in settings for item in ("--set", setting)),
        env={"CROSSTRAIN_TEST_FAIL_STEP": str(FAIL_STEP), "TMPDIR": str(temporary)},
    )  # fmt: skip
    assert_failed_naming_the_rank(failed, f"RuntimeError: injected failure at step {FAIL_STEP}")
    left = sorted(path.name for path in temporary.glob(TRACEBACK_FILES))
    assert not left, f"the failed run left {left} in its temporary folder"
    last = FAIL_STEP // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert complete_checkpoints(out)[-1][0] == last
    override = ("--backend", resume_backend) if resume_backend is not None else ()
    resumed = run_cli("-p", "no:progress", "run", "--out", str(out), "--resume", *override)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(out)["resumed_from_step"] == last
    assert summary(out)["backend"] == (resume_backend or backend)
    assert summary(out)["world_size"] == nproc  # as the run ran, on its device (its launch.json's)
    assert read_launch_record(out) == Layout(resume_backend or backend, nproc, device="cpu")
    every_checkpoint = [*range(CHECKPOINT_EVERY, STEPS, CHECKPOINT_EVERY), STEPS]  # and the end's
    assert [step for step, _ in complete_checkpoints(out)] == every_checkpoint[-3:]  # keep_checkpoints
    return out


def resume_a_copy(run: Path, out: Path, step: int, *flags: str) -> Path:
    """A copy of the finished ``run`` in ``out`` cut back to its checkpoint of ``step`` (the
    later ones removed), continued by ``--resume`` with ``flags`` (another backend, world or
    shard mode); ``out``."""
    shutil.copytree(run, out)
    for later, path in complete_checkpoints(out):
        if later > step:
            shutil.rmtree(path)
    resumed = run_cli("-p", "no:progress", "run", "--out", str(out), "--resume", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(out)["resumed_from_step"] == step
    return out


def start_from(backend: str, plan: Path, source: Path, out: Path, nproc: int) -> dict[str, float]:
    """A new one-step run of ``plan`` on ``backend`` with ``--init-from source`` (a finished
    run's folder); the evaluation of its starting weights, which it records at step 0."""
    result = run_cli(
        "-p", "no:progress", "run", str(plan), "--backend", backend, "--nproc", str(nproc), "--device", "cpu",
        "--out", str(out), "--init-from", str(source), "--set", "train.max_steps=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and "eval" in records[0], records[:2]
    assert summary(out)["steps"] == 1 and summary(out)["resumed_from_step"] is None  # a new run
    return dict(records[0]["eval"])


def spoken_plans(backend: str, directory: Path) -> list[str]:
    """The names of :data:`PLANS` whose every layer, loss, optimizer and precision the
    backend declares."""
    strategy = get_backend(make_plugin_manager(), backend)()
    if not isinstance(strategy, SpeaksVocabulary):
        return list(PLANS)
    spoken = []
    for name in PLANS:
        try:
            plan = load_plan(write_plan(directory / name, name), PLAN_SETTINGS.get(name, ()))
            check_plan_vocabulary(plan, strategy.vocabulary(), backend)
        except PlanError:
            continue
        spoken.append(name)
    return spoken
