"""The backend's vocabulary is its tables' keys, and crosstrain refuses a plan that uses a
name outside it before anything starts, naming the plan field."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import crosstrain
import pytest
from crosstrain import DECAY_MODES, PlanError, Vocabulary
from crosstrain.core.spec.plan import WEIGHT_DTYPES
from crosstrain.core.spec.vocabulary import missing_names  # the check's own helper, tested here

from crosstrain_jax import JaxStrategy
from crosstrain_jax.layers import LAYERS
from crosstrain_jax.model import LOSSES, METRIC_COUNTS
from crosstrain_jax.nodes import PRECISIONS
from crosstrain_jax.optimizer import OPTIMIZERS
from crosstrain_jax.strategy import table_vocabulary
from jaxtest_support import run_cli


def test_the_vocabulary_is_what_the_tables_hold() -> None:
    # declared (the launching process imports no jax), and the tables' keys exactly
    vocabulary = JaxStrategy.vocabulary()
    assert vocabulary == table_vocabulary() == Vocabulary.of(
        LAYERS, LOSSES, OPTIMIZERS, PRECISIONS, METRIC_COUNTS, DECAY_MODES,
        shard=("none", "optimizer", "full"))
    # every core layer type (block is core's structure, not a layer to build), every loss,
    # optimizer, counted metric and decay mode, and every shard mode (ZeRO-1 and ZeRO-3);
    # fp16 would need a loss scaler, which this example leaves out
    assert missing_names(vocabulary) == {"precisions": ["fp16"]}
    # the weights' dtype of each precision is crosstrain's, so checkpoints move between backends
    assert {name: str(compute.full) for name, compute in PRECISIONS.items()} == {
        name: WEIGHT_DTYPES[name] for name in PRECISIONS}


def test_checking_a_plan_and_finding_jax_import_no_jax() -> None:
    # what crosstrain asks in the launching process, which never runs a step
    code = ("import sys\n"
            "from crosstrain_jax import JaxStrategy\n"
            "assert JaxStrategy.framework_installed().importable\n"
            "JaxStrategy.vocabulary()\n"
            "print('jax' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_reading_the_tables_starts_no_jax_backend() -> None:
    # the tables' modules import jax; a started backend would claim the GPUs' memory
    code = ("from crosstrain_jax.strategy import table_vocabulary\n"
            "table_vocabulary()\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_fp16_is_refused_before_launch_with_the_field_named(
    write_plan: Callable[..., Path], tmp_path: Path
) -> None:
    result = run_cli("-p", "no:tf", "run", str(write_plan()), "--backend", "jax",
                     "--set", "train.precision='fp16'", "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"crosstrain: error: {tmp_path / 'plan.toml'}: train.precision: "
        "the jax backend has no precision 'fp16'"]
    assert not (tmp_path / "run").exists()


def test_a_layer_the_backend_does_not_declare_is_refused_naming_its_field(
    token_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Take attention out of the vocabulary and the plan that uses it in a block is refused
    # before the output folder or a worker exists.
    without = attrs.evolve(table_vocabulary(), layers=table_vocabulary().layers - {"attention"})
    monkeypatch.setattr(JaxStrategy, "vocabulary", classmethod(lambda cls: without))
    with pytest.raises(PlanError) as refused:
        crosstrain.fit(token_plan, backend="jax", device="cpu", out=tmp_path / "run")
    assert refused.value.field == "model.blocks.decoder.layers[1]"
    assert str(refused.value).endswith("the jax backend has no 'attention'")
    assert not (tmp_path / "run").exists()
