"""``crosstrain export --format keras`` and tf's ``predict``: the plan's graph rebuilt from
stock Keras layers (so ``keras.saving.load_model`` needs no crosstrain), and what has no
stock layer refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.errors import InputError
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.plans import GPT_PLAN, RESNET_PLAN

pytest.importorskip("tensorflow")

import keras

from crosstrain.backends.tf.export import stock_model
from crosstrain.backends.tf.strategy import TfStrategy

pytestmark = pytest.mark.tf

#: every layer with a stock Keras form, beside the resnet's convolutions and batch norm
STOCK_PLAN = """
name = "stock"
[model]
input_shape = [12]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 20, units = 8 },
  { type = "layernorm" },
  { type = "gelu" },
  { type = "dropout", rate = 0.3 },
  { type = "flatten" },
  { type = "dense", units = 16 },
  { type = "tanh", name = "x" },
  { type = "relu", inputs = ["x"] },
  { type = "add", inputs = ["x", "relu_7"] },
  { type = "dense", units = 5 },
]
[data]
source = "npz"
path = "unused.npz"
"""


def _weights(plan_path: Path) -> dict[str, np.ndarray]:
    """Initial weights with batch-norm statistics that are not the identity."""
    weights = dict(initial_weights(load_plan(plan_path)))
    rng = np.random.default_rng(1)
    for name in weights:
        if name.endswith(("moving_mean", "moving_variance", ".scale", ".offset")):
            weights[name] = rng.uniform(0.5, 1.5, weights[name].shape).astype(np.float32)
    return weights


#: the resnet reading raw pixels (0..16), scaled as a plan asks: the export applies it too.
#: Its layers take the names the export's own input and scaling layers would (a Keras
#: model's names are unique), as STOCK_PLAN's tanh takes "x"
SCALED_RESNET_PLAN = RESNET_PLAN.replace(
    'source = "digits"', 'source = "digits"\nscale = 0.0625\nmean = [0.25]\nstd = 0.5'
).replace(
    '{ type = "global_avg_pool2d" },\n  { type = "dense", units = 10 },',
    '{ type = "global_avg_pool2d", name = "normalise" },\n  { type = "dense", units = 10, name = "scale" },',
)


@pytest.mark.parametrize(
    ("text", "rows"),
    [
        (SCALED_RESNET_PLAN, lambda rng: rng.uniform(0, 16, (9, 8, 8, 1)).astype(np.float32)),
        (STOCK_PLAN, lambda rng: rng.integers(0, 20, (9, 12)).astype(np.int32)),
    ],
    ids=["resnet", "stock"],
)
def test_the_saved_model_computes_what_predict_does(tmp_path: Path, text: str, rows: object) -> None:
    (tmp_path / "plan.toml").write_text(text)
    plan = load_plan(tmp_path / "plan.toml")
    strategy = TfStrategy.local("cpu")
    state = strategy.build(plan, _weights(tmp_path / "plan.toml"))
    x = rows(np.random.default_rng(2))  # type: ignore[operator]  # raw, as predict reads them
    [path] = strategy.export(state, "keras", tmp_path / "out", x[:4])
    loaded = keras.saving.load_model(str(path))
    assert all(type(layer).__module__.startswith("keras.") for layer in loaded.layers)  # stock only
    scaling = plan.data.scaling
    if not scaling.is_identity:  # the model begins with the plan's scaling, as stock layers
        assert [type(layer) for layer in loaded.layers[1:3]] == [
            keras.layers.Rescaling,
            keras.layers.Normalization,
        ]
        expected = strategy.predict(state, scaling.apply(x))
    else:
        expected = strategy.predict(state, x)
    assert np.max(np.abs(loaded.predict(x, verbose=0) - expected)) <= 1e-5


def test_a_layer_without_a_stock_keras_layer_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "gpt.toml").write_text(GPT_PLAN.replace('path = "tokens.npy"', 'path = "unused.npy"'))
    with pytest.raises(InputError) as refused:
        stock_model(load_plan(tmp_path / "gpt.toml"), {})
    assert str(refused.value) == (
        "--format keras: model.layers[1] ('position_embedding') has no stock Keras layer; "
        "--format torch exports every layer"
    )
