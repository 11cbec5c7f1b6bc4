"""The tf backend's transformer vocabulary beyond the shared parity cases: a tied output is one
variable (the embedding's), exported to stock Keras as a Dense holding a copy of the table,
beside Keras's own RMSNormalization."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.spec.planfile import load_plan

pytest.importorskip("tensorflow")

import keras

from crosstrain.backends.tf.strategy import TfStrategy

pytestmark = pytest.mark.tf

TIED_PLAN = """
name = "tied"
[model]
input_shape = [6]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 11, units = 4, name = "tokens" },
  { type = "rmsnorm" },
  { type = "dense", units = 11, tie = "tokens" },
]
[data]
source = "npz"
path = "unused.npz"
"""


def test_a_tied_output_is_the_embedding_s_variable_and_exports_as_stock_keras(tmp_path: Path) -> None:
    (tmp_path / "plan.toml").write_text(TIED_PLAN)
    plan = load_plan(tmp_path / "plan.toml")
    rng = np.random.default_rng(5)
    weights = {
        name: rng.normal(size=value.shape).astype(np.float32)
        for name, value in plan.model.graph().init_weights(0).items()
    }
    strategy = TfStrategy.local("cpu")
    state = strategy.build(plan, weights)
    # one table among the trainable variables: the dense holds its bias alone
    assert sorted(tuple(v.shape) for v in state.model.trainable_variables) == [(4,), (11,), (11, 4)]
    x = rng.integers(0, 11, (5, 6)).astype(np.int32)
    expected = strategy.predict(state, x)
    embedded = weights["tokens.table"][x]
    normed = (
        embedded / np.sqrt(np.mean(embedded**2, axis=-1, keepdims=True) + 1e-6) * weights["rmsnorm_1.scale"]
    )
    np.testing.assert_allclose(
        expected, normed @ weights["tokens.table"].T + weights["dense_2.bias"], atol=1e-5
    )
    [path] = strategy.export(state, "keras", tmp_path / "out", x[:4])
    loaded = keras.saving.load_model(str(path))
    assert [type(layer).__name__ for layer in loaded.layers[1:]] == ["Embedding", "RMSNormalization", "Dense"]
    assert np.max(np.abs(loaded.predict(x, verbose=0) - expected)) <= 1e-5
