"""tf across machines, on loopback: two launchers as two "machines" and the processes
torchrun or srun would start, each running the CLI, form one MultiWorkerMirroredStrategy
cluster (TF_CONFIG built from the same facts), whose per-step losses equal
``--workers 2`` on one machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.backends.host import free_port
from crosstrain.testing import launches
from crosstrain.testing.launches import RunCache
from tests.conftest import run_cli_together, worker_env
from tests.support import step_losses, summary

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf

STEPS = ["--backend", "tf", "--set", f"train.max_steps={launches.STEPS}", "--device", "cpu"]


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    return launches.write_plan(tmp_path / "plan", "resnet")


@pytest.fixture
def two_workers(runs: RunCache) -> np.ndarray:
    """Per-step losses of two tf workers started by one launcher on one machine (the
    session's run, which tests/tf/test_distributed.py compares with one replica)."""
    return step_losses(runs("tf", "resnet", 2, flags=("--workers", "2")))


def _check(results: list[object], out: Path, two_workers: np.ndarray) -> None:
    for result in results:
        assert result.returncode == 0, result.stderr  # type: ignore[attr-defined]
    assert (summary(out)["world_size"], summary(out)["processes"]) == (2, 2)
    np.testing.assert_allclose(step_losses(out), two_workers, rtol=0, atol=1e-6)


def test_two_machines_form_one_cluster(plan: Path, tmp_path: Path, two_workers: np.ndarray) -> None:
    out, endpoint = tmp_path / "two", f"127.0.0.1:{free_port()}"
    node = ["run", str(plan), "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--out", str(out)]
    results = run_cli_together(
        *(([*node, "--node-rank", str(rank), *STEPS], worker_env()) for rank in (1, 0))  # node 0 last
    )
    _check(results, out, two_workers)


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_an_outside_launchers_processes_form_one_cluster(
    plan: Path, tmp_path: Path, two_workers: np.ndarray, launcher: str
) -> None:
    """Not two separate single-worker jobs into one folder: one 2-worker cluster."""
    out, port = tmp_path / launcher, str(free_port())
    if launcher == "torchrun":
        shared = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        ranks = [{"RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in (0, 1)]
    else:
        shared = {
            "SLURM_NTASKS": "2",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": "9",
            "MASTER_PORT": port,
        }
        ranks = [{"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)} for rank in (0, 1)]
    arguments = ["run", str(plan), "--out", str(out), *STEPS]
    results = run_cli_together(*((arguments, {**worker_env(), **shared, **rank}) for rank in ranks))
    _check(results, out, two_workers)
