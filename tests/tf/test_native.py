"""The native escape hatch on tf: a Keras model of the user's own, here a language model on
int token ids returning [batch, length, vocabulary] logits. The loss and the token data path
are the same as for a neutral model."""

from __future__ import annotations

from pathlib import Path

import pytest

from crosstrain.testing.data_plans import write_tokens
from crosstrain.testing.plans import GPT_PLAN
from tests.conftest import run_cli
from tests.support import step_losses, summary

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


def test_a_native_keras_language_model_trains_on_two_replicas(tmp_path: Path) -> None:
    write_tokens(str(tmp_path / "tokens.npy"))
    (tmp_path / "native_keras_lm.py").write_text(
        "import keras\n"
        "def build(plan):\n"
        "    return keras.Sequential([keras.Input(shape=(16,), dtype='int32'),\n"
        "                             keras.layers.Embedding(32, 16), keras.layers.Dense(32)])\n"
    )
    (tmp_path / "plan.toml").write_text(
        GPT_PLAN.replace("layers = [", 'native = { tf = "native_keras_lm:build" }\nlayers = [', 1)
    )
    # native_keras_lm.py lies beside the plan, not on PYTHONPATH: the plan's folder is on the path
    out = tmp_path / "run"
    arguments = ["run", str(tmp_path / "plan.toml"), "--backend", "tf", "--nproc", "2", "--out", str(out)]
    result = run_cli(*arguments, "--device", "cpu", "--set", "train.max_steps=30")
    assert result.returncode == 0, result.stderr
    losses = step_losses(out)
    assert losses[-5:].mean() < losses[:5].mean()
    assert summary(out)["eval"]["count"] == 25 * 16  # every position of the 25 eval windows
