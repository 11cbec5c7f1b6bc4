"""The new vocabulary on real replicas: MirroredStrategy over two logical CPU devices, one
fresh process (tests/tf/workers.py's graph_main) for both plans, and batch norm across two
worker processes (MultiWorkerMirroredStrategy) through crosstrain.fit.

Batch norm's statistics cover the real rows of every replica and dropout's masks hash
global row positions, so two replicas must train like one; so must a token model
(int32 ids, embedding, causal attention, per-token cross-entropy).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crosstrain.testing.launches import RunCache, made_once, shared_folder
from tests.conftest import json_from_fresh_process
from tests.support import assert_same_eval, max_relative_difference, step_losses, summary

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf

#: two worker processes of one replica each
WORKERS = ("--workers", "2")

BATCHNORM_PLAN = """
name = "batchnorm_cnn"
seed = 5
metrics = ["loss", "accuracy"]
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 4, kernel_size = [3, 2] },
  { type = "batchnorm", name = "bn" },
  { type = "relu" },
  { type = "avgpool2d", pool_size = 2 },
  { type = "dropout", rate = 0.25, name = "drop" },
  { type = "global_avg_pool2d", name = "gap" },
  { type = "flatten", inputs = ["drop"], name = "flat" },
  { type = "dense", units = 8, name = "proj" },
  { type = "concat", inputs = ["gap", "proj"], name = "joined" },
  { type = "batchnorm", name = "bn2", momentum = 0.8 },
  { type = "dense", units = 10, name = "head" },
]
[data]
source = "digits"
[optimizer]
name = "sgd"
momentum = 0.9
[train]
global_batch_size = 32
grad_accum_steps = 2
"""

TOKEN_PLAN = """
name = "token_decoder"
seed = 2
metrics = ["loss", "accuracy"]
[model]
input_shape = [8]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 16, units = 8 },
  { type = "position_embedding" },
  { type = "block", block = "decoder", repeat = 2 },
  { type = "dropout", rate = 0.1 },
  { type = "dense", units = 16 },
]
[model.blocks.decoder]
layers = [
  { type = "attention", heads = 2, causal = true, name = "att" },
  { type = "add", inputs = ["input", "att"], name = "residual" },
  { type = "layernorm", name = "norm" },
]
[data]
source = "tokens"
path = "{tokens}"
sequence_length = 8
[optimizer]
# not Adam: attention's key bias has a gradient of exactly 0 up to rounding, which Adam
# would scale up to steps of lr in a direction the rounding picks
name = "sgd"
momentum = 0.9
[train]
global_batch_size = 32
"""


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """tests/tf/workers.py's graph checks run once per session in a fresh process."""

    def make(directory: Path) -> None:
        tokens = directory / "tokens.npy"
        np.save(tokens, np.random.default_rng(3).integers(0, 16, size=8 * 200 + 1).astype(np.int64))
        plans = {"batchnorm.toml": BATCHNORM_PLAN, "tokens.toml": TOKEN_PLAN.replace("{tokens}", str(tokens))}
        for name, text in plans.items():
            (directory / name).write_text(textwrap.dedent(text))
        paths = (str(directory / name) for name in plans)
        measured = json_from_fresh_process("tests.tf.workers:graph_main", *paths, timeout=300)
        (directory / "measured.json").write_text(json.dumps(measured))

    folder = made_once(shared_folder(tmp_path_factory) / "graph-replicas", make)
    return dict(json.loads((folder / "measured.json").read_text()))


def _assert_world_2_trains_like_world_1(run: dict[str, Any]) -> None:
    losses_one = np.array(run["losses_one"])
    assert len(losses_one) >= 5 and np.all(np.isfinite(losses_one))
    assert max_relative_difference(np.array(run["losses_two"]), losses_one) <= 1e-5
    assert run["max_weight_difference"] <= 1e-5
    assert run["replica_mismatches"] == []  # moving statistics and slots included
    assert run["traces"] == 1  # a new step number is a tensor, not a retrace


def test_batchnorm_and_dropout_at_two_replicas_train_like_one(checks: dict[str, dict[str, Any]]) -> None:
    run = checks["batchnorm_cnn"]
    _assert_world_2_trains_like_world_1(run)
    assert {"bn.moving_mean", "bn.moving_variance", "bn2.moving_mean"} <= set(run["weights_two"])
    assert run["half_batch_count"] == 16
    assert_same_eval(run["eval_two"], run["eval_one"])


def test_a_token_model_at_two_replicas_trains_like_one(checks: dict[str, dict[str, Any]]) -> None:
    run = checks["token_decoder"]
    _assert_world_2_trains_like_world_1(run)
    # every position of a row is a target: counts are rows x 8
    assert run["targets_per_row"] == 8
    assert run["half_batch_count"] == 16 * 8
    assert run["eval_one"]["count"] == 40 * 8
    assert_same_eval(run["eval_two"], run["eval_one"])


def test_batchnorm_statistics_span_worker_processes(runs: RunCache) -> None:
    """Two processes of one replica each (MultiWorkerMirroredStrategy): batch norm's sums
    cross the process boundary. The residual network's --workers 2 run (which the
    multi-machine checks compare with too) against the conformance suite's world-1 run."""
    one = runs("tf", "resnet", 1)
    workers = runs("tf", "resnet", 2, flags=WORKERS)
    assert (summary(workers)["world_size"], summary(workers)["processes"]) == (2, 2)
    assert max_relative_difference(step_losses(workers), step_losses(one)) <= 1e-5
    # trained weights, apart by float rounding: eval within the step tolerance, a tie may flip
    assert_same_eval(summary(workers)["eval"], summary(one)["eval"], loss_tolerance=1e-5, flips=1)
