"""A checkpoint of a sharded torch run is neutral: tf, which shards no parameters, refuses to
train ``"full"`` but resumes the sharded world-2 run's step-6 checkpoint unsharded at world 1,
and its steps 7-12 are the sharded run's within parity. Both frameworks shard the optimizer
(``"optimizer"``, ZeRO-1) alike: the same steps within parity, and one framework's sharded
checkpoint continues sharded on the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import check_shard_mode
from crosstrain.testing.launches import RunCache
from crosstrain.testing.plans import DROPOUT_MLP_PLAN
from crosstrain.testing.run_checks import PARITY_TOLERANCE, resume_a_copy
from crosstrain.testing.runs import max_relative_difference, step_losses, summary

pytest.importorskip("torch")
pytest.importorskip("tensorflow")

from crosstrain.backends.tf.strategy import TfStrategy

pytestmark = pytest.mark.cross

#: the sharded run tests/torch/test_shard.py compares with the unsharded one
SHARDED = ("train.shard='full'", "output.checkpoint_every_steps=6")


def test_tf_refuses_full_naming_why(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(DROPOUT_MLP_PLAN)
    with pytest.raises(
        PlanError, match=r"train\.shard: the tf backend has no shard mode 'full': tf\.distribute"
    ):
        check_shard_mode(load_plan(path, ("train.shard='full'",)), TfStrategy.vocabulary(), "tf")


def test_a_sharded_torch_checkpoint_resumes_unsharded_on_tf(runs: RunCache, tmp_path: Path) -> None:
    sharded = runs("torch", "gpt2_small", 2, *SHARDED)
    out = resume_a_copy(
        sharded, tmp_path / "run", 6, "--backend", "tf", "--nproc", "1", "--set", "train.shard='none'"
    )
    assert summary(out)["backend"] == "tf"
    assert summary(out)["world_size"] == 1
    losses, reference = step_losses(out), step_losses(sharded)
    assert len(losses) == len(reference) == 12
    assert max_relative_difference(losses[6:], reference[6:]) <= PARITY_TOLERANCE


#: the optimizer-sharded torch run, with the checkpoint tf continues from
OPTIMIZER_SHARDED = ("train.shard='optimizer'", "output.checkpoint_every_steps=6")


def test_torch_and_tf_shard_the_optimizer_alike_and_continue_each_other(
    runs: RunCache, tmp_path: Path
) -> None:
    torch_run = runs("torch", "dropout_mlp", 2, *OPTIMIZER_SHARDED)
    tf_run = runs("tf", "dropout_mlp", 2, *OPTIMIZER_SHARDED)
    assert max_relative_difference(step_losses(tf_run)[:10], step_losses(torch_run)[:10]) <= PARITY_TOLERANCE
    out = resume_a_copy(torch_run, tmp_path / "run", 6, "--backend", "tf")
    assert (summary(out)["backend"], summary(out)["world_size"]) == ("tf", 2)
    assert summary(out)["memory_per_rank"] == summary(tf_run)["memory_per_rank"]  # sharded on tf too
    assert max_relative_difference(step_losses(out)[6:], step_losses(torch_run)[6:]) <= PARITY_TOLERANCE
