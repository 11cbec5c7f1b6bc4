"""The tf backend on real replicas: MirroredStrategy over two logical CPU devices and
MultiWorkerMirroredStrategy over two local processes. World N trains as world 1 (crosstrain's
batches, the loss normalised by the global count of real rows), end to end.

TensorFlow's distributed code always runs in fresh processes (the CLI, crosstrain.fit's
workers, or tests/tf/workers.py), never in pytest's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crosstrain
from crosstrain.backends.host import free_port
from crosstrain.core.errors import BackendError
from crosstrain.testing.launches import RunCache, made_once, shared_folder
from tests.conftest import MLP_PLAN, REPO, json_from_fresh_process, worker_env
from tests.support import assert_same_eval, max_relative_difference, step_losses, summary

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


def _odd_npz_plan(directory: Path) -> Path:
    """MLP_PLAN on 203 random rows with a batch of 16: the eval set (41 rows) and the
    train set (162 rows) are not multiples of the batch, so padding is exercised."""
    rng = np.random.default_rng(7)
    data = directory / "odd.npz"
    np.savez(data, x=rng.normal(size=(203, 64)).astype(np.float32), y=rng.integers(0, 10, size=203))
    text = MLP_PLAN.replace('source = "digits"', f'source = "npz"\npath = "{data}"')
    plan = directory / "odd.toml"
    plan.write_text(text.replace("global_batch_size = 32", "global_batch_size = 16"))
    return plan


# --------------------------------------------------------------------------- replicas in hand


@pytest.fixture(scope="module")
def replica_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/tf/workers.py run once per session in a fresh process; what it measured."""

    def make(directory: Path) -> None:
        digits = directory / "digits.toml"
        digits.write_text(MLP_PLAN)
        npz_plan = str(_odd_npz_plan(directory))
        measured = json_from_fresh_process("tests.tf.workers:main", str(digits), npz_plan, timeout=180)
        (directory / "measured.json").write_text(json.dumps(measured))

    folder = made_once(shared_folder(tmp_path_factory) / "replicas", make)
    return dict(json.loads((folder / "measured.json").read_text()))


def test_two_replicas_compute_their_own_rows(replica_checks: dict[str, Any]) -> None:
    # a batch whose second half is padding: replica 0 holds the 16 real rows, replica 1 none
    assert replica_checks["half_batch_count"] == 16
    # with both replicas on the same rows, the summed gradient would not be world 1's
    losses_one = np.array(replica_checks["losses_one"])
    assert max_relative_difference(np.array(replica_checks["losses_two"]), losses_one) <= 1e-6
    assert replica_checks["max_weight_difference"] <= 1e-6


def test_weights_and_optimizer_state_stay_identical_across_replicas(replica_checks: dict[str, Any]) -> None:
    assert replica_checks["replica_mismatches"] == []


def test_the_train_step_is_traced_once(replica_checks: dict[str, Any]) -> None:
    assert replica_checks["traces"] == 1


def test_eval_at_world_2_equals_world_1(replica_checks: dict[str, Any]) -> None:
    assert replica_checks["eval_one"]["count"] == 41  # 203 rows x 0.2, batch 16: padded
    # counts and hits exactly; the loss within fp32 rounding of rows in batches of 8 vs 16
    assert_same_eval(replica_checks["eval_two"], replica_checks["eval_one"])


# --------------------------------------------------------------------------- whole runs


def test_two_workers_train_like_one_replica(runs: RunCache) -> None:
    """MultiWorkerMirroredStrategy, one replica per worker process, against the conformance
    suite's world-1 run: the same steps (batch norm's statistics across the processes:
    tests/tf/test_graph_replicas.py), every eval row counted once, the weights saved."""
    one, workers = runs("tf", "resnet", 1), runs("tf", "resnet", 2, flags=("--workers", "2"))
    result = summary(workers)
    assert (result["world_size"], result["processes"]) == (2, 2)
    assert max_relative_difference(step_losses(workers), step_losses(one)) <= 1e-5
    assert result["eval"]["count"] == summary(one)["eval"]["count"] == 359  # digits' eval rows
    assert (workers / "model.safetensors").is_file()


def test_replicas_that_do_not_split_over_workers_are_refused(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    with pytest.raises(BackendError, match="do not split evenly over 3 workers"):
        crosstrain.fit(write_plan(), backend="tf", nproc=4, workers=3, out=tmp_path / "run")


# --------------------------------------------------------------------------- the CLI


def test_processes_started_with_tf_config_join_that_cluster(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    """As under a cluster manager: each process gets its own TF_CONFIG and runs the CLI."""
    ports = [free_port(), free_port()]
    hosts = [f"127.0.0.1:{port}" for port in ports]
    plan, out = str(write_plan()), str(tmp_path / "run")
    processes = []
    for rank in range(2):
        env = worker_env()
        task = {"type": "worker", "index": rank}
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts}, "task": task})
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "crosstrain.cli",
                    "run",
                    plan,
                    "--backend",
                    "tf",
                    "--nproc",
                    "2",
                    "--out",
                    out,
                    "--set",
                    "train.max_steps=10",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
        )
    outputs = [process.communicate(timeout=180) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr
    assert (summary(tmp_path / "run")["world_size"], summary(tmp_path / "run")["processes"]) == (2, 2)
    assert len(step_losses(tmp_path / "run")) == 10  # written once, by rank 0
