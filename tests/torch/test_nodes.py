"""torch across machines, on loopback: two launchers as two "machines" (torchrun's c10d
rendezvous through the elastic agent), and the processes srun or Kubeflow would start,
each running the CLI. World 2 from two machines equals world 2 on one, step for step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.backends.host import free_port
from crosstrain.testing import launches
from crosstrain.testing.launches import RunCache
from tests.conftest import run_cli, run_cli_together, worker_env
from tests.support import step_losses, summary

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

STEPS = ["--set", f"train.max_steps={launches.STEPS}", "--device", "cpu"]


@pytest.fixture
def one_machine(runs: RunCache) -> np.ndarray:
    """Per-step losses of world 2 started by one launcher on one machine: the conformance
    suite's world-N run of the dropout MLP."""
    return step_losses(runs("torch", "dropout_mlp", 2))


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    return launches.write_plan(tmp_path / "plan", "dropout_mlp")


def test_two_machines_train_as_one_with_the_same_world(
    plan: Path, tmp_path: Path, one_machine: np.ndarray
) -> None:
    out, endpoint = tmp_path / "two", f"127.0.0.1:{free_port()}"
    node = ["run", str(plan), "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    results = run_cli_together(
        *(([*node, "--node-rank", str(rank), "--out", str(out), *STEPS], worker_env()) for rank in (0, 1))
    )
    for result in results:
        assert result.returncode == 0, result.stderr
    assert (summary(out)["world_size"], summary(out)["processes"]) == (2, 2)
    np.testing.assert_allclose(step_losses(out), one_machine, rtol=0, atol=1e-6)


@pytest.mark.parametrize("launcher", ["srun", "tfjob"])
def test_an_outside_launchers_processes_join_one_group(
    plan: Path, tmp_path: Path, one_machine: np.ndarray, launcher: str
) -> None:
    """As `srun --ntasks 2 crosstrain run ...` or a TFJob's two pods start them: no flag."""
    out, port = tmp_path / launcher, free_port()
    if launcher == "srun":
        shared = {
            "SLURM_NTASKS": "2",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": "77",
            "MASTER_PORT": str(port),
        }
        ranks = [{"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)} for rank in (0, 1)]
    else:  # torch meets at the first task's address
        hosts = [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]
        shared = {}
        ranks = [
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": rank}}
                )
            }
            for rank in (0, 1)
        ]
    arguments = ["run", str(plan), "--out", str(out), *STEPS]
    results = run_cli_together(*((arguments, {**worker_env(), **shared, **rank}) for rank in ranks))
    for result in results:
        assert result.returncode == 0, result.stderr
    assert summary(out)["world_size"] == 2
    np.testing.assert_allclose(step_losses(out), one_machine, rtol=0, atol=1e-6)


def test_a_machine_count_that_does_not_divide_nproc_is_refused(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    endpoint = "127.0.0.1:29400"
    result = run_cli(
        "run", str(write_plan()), "--nproc", "3", "--nnodes", "2", "--rdzv-endpoint", endpoint,
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "crosstrain: error: --nproc 3 is not a multiple of --nnodes 2 "
        "(--nproc counts the replicas on all machines)"
    )
    assert not (tmp_path / "o").exists()


def test_a_machine_that_never_comes_ends_the_rendezvous_with_one_line(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """Node 1 alone: no store at the endpoint; the wait ends at --timeout, naming the endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    result = run_cli(
        "run", str(write_plan()), "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-endpoint", endpoint, "--timeout", "2", "--out", str(tmp_path / "o"), "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"crosstrain: error: --rdzv-endpoint {endpoint}: the machines did not meet")
    )
