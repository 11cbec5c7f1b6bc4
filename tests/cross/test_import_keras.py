"""`crosstrain import` of Keras models: the imported plan computes the Keras model's forward
on torch and on tf (keras.applications at 32x32, a transformer encoder, a model of the
remaining converters), what cannot be imported is refused in one line, and an imported
plan trains from its weights (``model.init``) on both backends alike, through the CLI.

Forward checks run in this process on the backends' own predict (inference mode), from the
weights the import wrote; the Keras models' weights are moved off their start first (batch
norm's statistics included), so that every weight matters. The plans' outputs are logits
(the final softmax is left out), compared with the Keras model's output before its softmax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.imported import FORWARD_TOLERANCE, plan_outputs, relative_difference
from crosstrain.testing.runs import max_relative_difference, step_losses
from tests.conftest import run_cli, user_env

keras = pytest.importorskip("keras")
pytest.importorskip("torch")
pytest.importorskip("tensorflow")

from crosstrain import import_keras  # noqa: E402 (after the frameworks are known present)
from crosstrain.importers.keras_calls import ImportRefused  # noqa: E402

pytestmark = pytest.mark.cross

QUIET = ("-p", "no:progress")
#: torch and tf train the imported convnet alike over its first steps (as any plan's)
TRAIN_TOLERANCE = 1e-4
STEPS = 10


def moved_off_start(model: Any, seed: int = 0) -> Any:
    """Every weight moved off Keras's start: scales and variances drawn from [0.5, 1.5]
    (batch norm stays well conditioned), everything else jittered."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        value = keras.ops.convert_to_numpy(variable)
        if variable.path.endswith(("moving_variance", "gamma")):
            moved = rng.uniform(0.5, 1.5, value.shape)
        else:
            moved = value + rng.normal(0.0, 0.05, value.shape)
        variable.assign(moved.astype(value.dtype))
    return model


def keras_logits(model: Any, x: np.ndarray) -> np.ndarray:
    """The Keras model's outputs before its final softmax (which the import leaves out)."""
    last = model.layers[-1]
    if isinstance(last, keras.layers.Activation):
        model = keras.Model(model.inputs, last.input)
    elif getattr(last, "activation", None) is keras.activations.softmax:
        last.activation = keras.activations.linear
    return np.asarray(keras.ops.convert_to_numpy(model(x, training=False)))


def plan_weight_count(model: Any) -> int:
    """Keras's count of the model's weights, less a Normalization's mean, variance and
    count: the plan holds those as a rescale's constants, not as weights."""
    folded = sum(
        layer.count_params() for layer in model.layers if isinstance(layer, keras.layers.Normalization)
    )
    return int(model.count_params()) - folded


def assert_imports_with_its_forward(model: Any, tmp_path: Path, x: np.ndarray) -> Path:
    """Import ``model``; the plan's outputs on torch and on tf are the Keras model's."""
    notes: list[str] = []
    result = import_keras(model, tmp_path / "plan.toml", say=notes.append)
    assert result.weights == tmp_path / "init.safetensors"
    assert result.parameters == plan_weight_count(model)
    expected = keras_logits(model, x)
    for backend in ("torch", "tf"):
        difference = relative_difference(plan_outputs(result.plan, backend, x), expected)
        assert difference <= FORWARD_TOLERANCE, (backend, difference)
    return result.plan


def _images(shape: tuple[int, ...], rows: int = 3) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(rows, *shape)).astype(np.float32)


APPLICATIONS: dict[str, Callable[[], Any]] = {
    "ResNet50": lambda: keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=5),
    "MobileNetV2": lambda: keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=5),
    "DenseNet121": lambda: keras.applications.DenseNet121(weights=None, input_shape=(32, 32, 3), classes=5),
    "MobileNetV3Small": lambda: keras.applications.MobileNetV3Small(
        weights=None, input_shape=(32, 32, 3), classes=5
    ),
    # stochastic depth: Dropout(noise_shape=(None, 1, 1, 1)) becomes dropout per_row
    "EfficientNetB0": lambda: keras.applications.EfficientNetB0(
        weights=None, input_shape=(32, 32, 3), classes=5
    ),
    # Cropping2D aligns its cells' branches; 'same' pools
    "NASNetMobile": lambda: keras.applications.NASNetMobile(weights=None, input_shape=(32, 32, 3), classes=5),
}


@pytest.mark.parametrize("name", sorted(APPLICATIONS))
def test_a_keras_application_imports_with_its_forward(name: str, tmp_path: Path) -> None:
    model = moved_off_start(APPLICATIONS[name]())
    plan_file = assert_imports_with_its_forward(model, tmp_path, _images((32, 32, 3)))
    text = plan_file.read_text()
    assert 'init = "init.safetensors"' in text
    assert "final softmax ('predictions'" in text  # the note heads the plan too


def transformer_encoder(length: int = 12, vocabulary: int = 40, units: int = 16, heads: int = 4) -> Any:
    """One post-norm encoder block over token embeddings, pooled, then classes."""
    layers = keras.layers
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    x = layers.Embedding(vocabulary, units, name="embed")(tokens)
    attended = layers.MultiHeadAttention(num_heads=heads, key_dim=units // heads, name="attention")(x, x)
    x = layers.Add(name="residual1")([x, attended])
    x = layers.LayerNormalization(epsilon=1e-6, name="norm1")(x)
    hidden = layers.Dense(32, activation="gelu", name="mlp_in")(x)
    hidden = layers.Dense(units, name="mlp_out")(hidden)
    x = layers.Add(name="residual2")([x, hidden])
    x = layers.LayerNormalization(epsilon=1e-6, name="norm2")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    classes = layers.Dense(3, activation="softmax", name="classes")(x)
    return keras.Model(tokens, classes, name="encoder")


def test_a_transformer_encoder_imports_with_its_forward(tmp_path: Path) -> None:
    model = moved_off_start(transformer_encoder())
    tokens = np.random.default_rng(1).integers(0, 40, size=(4, 12)).astype(np.int32)
    plan_file = assert_imports_with_its_forward(model, tmp_path, tokens)
    plan = load_plan(plan_file)
    assert plan.model.input_dtype == "int32"
    assert [layer.type for layer in plan.model.layers][:3] == ["embedding", "attention", "add"]


def every_other_converter() -> Any:
    """The converters the models above leave out, in one small model: rescalings and
    normalisations (one value, per channel), separable, transposed, depthwise (with a multiplier) and 1-D
    convolutions, pools with strides and 'same' padding, batch norms without scale or
    offset, bilinear upsampling, a softmax inside the model, hard_sigmoid, ops on tensors
    (``x - 0.25``), reshape, permute, merges, identity, ``x[:, -1]``."""
    layers = keras.layers
    pixels = keras.Input((12, 12, 3), name="pixels")
    x = layers.Rescaling(0.25, offset=0.5, name="rescale")(pixels)
    x = layers.Normalization(mean=0.2, variance=2.0, name="normalize")(x)
    # per channel (EfficientNetV2's and ConvNeXt's ImageNet statistics): a rescale of vectors
    imagenet = {"mean": [0.485, 0.456, 0.406], "variance": [0.052, 0.050, 0.051]}
    x = layers.Normalization(**imagenet, name="normalize_channels")(x)
    x = layers.Rescaling([1.0, 0.5, 2.0], offset=0.1, name="rescale_channels")(x)
    x = layers.SeparableConv2D(6, 3, padding="same", depth_multiplier=2, activation="relu", name="sep")(x)
    x = layers.Conv2DTranspose(4, 3, strides=2, padding="same", name="up_conv")(x)
    x = layers.AveragePooling2D(3, strides=2, name="avg")(x)
    x = layers.UpSampling2D(2, interpolation="bilinear", name="upsample")(x)
    x = layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2, activation="hard_sigmoid", name="dw")(x)
    gate = layers.Dense(8, activation="softmax", name="gate")(x)
    x = layers.Multiply(name="gated")([x, gate])
    x = layers.LeakyReLU(0.1, name="leaky")(x)
    # 'same' pools (Xception's, NASNet's): max over real cells, avg divided by their count
    x = layers.MaxPooling2D(3, strides=1, padding="same", name="max_same")(x)
    x = layers.AveragePooling2D(2, strides=1, padding="same", name="avg_same")(x)
    # InceptionV3's batch norm: no scale (and one with no offset)
    x = layers.BatchNormalization(scale=False, name="bn_unscaled")(x)
    x = layers.BatchNormalization(center=False, name="bn_uncentered")(x)
    x = layers.ZeroPadding2D(((1, 0), (0, 1)), name="pad")(x - 0.25)
    x = layers.Conv2D(8, 2, dilation_rate=2, activation="tanh", name="dilated")(x)
    capped = layers.ReLU(max_value=6.0, name="capped")(x)
    x = layers.Concatenate(name="both")([x, capped])
    x = layers.Reshape((81, 16), name="sequence")(x)
    x = layers.Conv1D(8, 3, strides=2, padding="same", activation="swish", name="conv1d")(x)
    x = layers.Permute((2, 1), name="swap")(x)
    x = layers.MultiHeadAttention(1, 41, use_bias=False, name="unbiased")(x, x)
    x = layers.LayerNormalization(name="norm")(x)
    x = layers.Identity(name="same")(x)
    x = layers.Dropout(0.3, name="drop")(x)
    x = layers.Flatten(name="flat")(x[:, -1])  # ViT's head reads one position: a take
    outputs = layers.Dense(4, name="out")(x)
    return keras.Model(pixels, outputs, name="every_other")


def test_every_other_converter_imports_with_its_forward(tmp_path: Path) -> None:
    model = moved_off_start(every_other_converter())
    plan_file = assert_imports_with_its_forward(model, tmp_path, _images((12, 12, 3), rows=4))
    written = load_plan(plan_file).model.layers
    layers = {layer.name: layer for layer in written}
    assert (layers["sep_depthwise"].groups, layers["sep_depthwise"].filters) == (3, 6)
    assert layers["sep"].kernel_size == (1, 1)
    assert layers["gate_linear"].type == "dense" and layers["gate"].type == "softmax"
    assert (layers["subtract"].type, layers["subtract"].offset) == ("rescale", -0.25)  # x - 0.25
    names = [layer.name for layer in written]
    assert names[names.index("norm") + 1] == "drop"  # identity passes its input through
    assert "same" not in names
    assert (layers["bn_unscaled"].scale, layers["bn_uncentered"].center) == (False, False)
    assert len(layers["normalize_channels"].scale) == 3 and layers["rescale_channels"].offset == 0.1
    assert names[names.index("drop") + 1 : names.index("flat")] == ["get_item"]
    assert (layers["get_item"].type, layers["get_item"].index) == ("take", -1)


def convnext_pieces() -> Any:
    """What ConvNeXt adds to the converters above, small: a Sequential stem and a Functional
    block used as layers (opened into the plan), keras.applications' LayerScale; NASNet's
    Cropping2D, InceptionResNetV2's CustomScaleLayer (a residual sum with the branch scaled)."""
    from keras.src.applications.convnext import LayerScale
    from keras.src.applications.inception_resnet_v2 import CustomScaleLayer

    layers = keras.layers
    stem = keras.Sequential(
        [layers.Conv2D(8, 2, strides=2, name="stem_conv"), layers.LayerNormalization(name="stem_norm")],
        name="stem",
    )
    features = keras.Input((5, 5, 8), name="block_in")
    hidden = layers.Dense(16, activation="gelu", name="block_expand")(features)
    block = keras.Model(features, layers.Dense(8, name="block_project")(hidden), name="block")
    pixels = keras.Input((10, 10, 3), name="pixels")
    x = stem(pixels)
    branch = LayerScale(0.1, 8, name="layer_scale")(block(x))
    x = CustomScaleLayer(0.17, name="residual")([x, branch])
    x = layers.Cropping2D(((1, 0), (0, 2)), name="crop")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(pixels, layers.Dense(3, name="out")(x), name="convnext_pieces")


def test_nested_models_and_keras_applications_own_layers_import_with_their_forward(tmp_path: Path) -> None:
    model = moved_off_start(convnext_pieces())
    plan_file = assert_imports_with_its_forward(model, tmp_path, _images((10, 10, 3), rows=4))
    written = load_plan(plan_file).model.layers
    names = [layer.name for layer in written]
    # the nested models' layers in place, under their own names; theirs are left out
    assert names[:4] == ["stem_conv", "stem_norm", "block_expand", "block_project"]
    assert "stem" not in names and "block" not in names
    layers = {layer.name: layer for layer in written}
    assert (layers["residual_scaled"].scale, layers["residual_scaled"].inputs) == (0.17, None)
    assert (layers["residual"].type, layers["residual"].inputs) == ("add", ("stem_norm", "residual_scaled"))
    assert (layers["layer_scale"].type, layers["layer_scale"].initial) == ("layer_scale", 0.1)
    assert (layers["crop"].type, layers["crop"].cropping) == ("crop2d", ((1, 0), (0, 2)))


def _attention_refusal(call: Callable[[Any, Any], Any]) -> str:
    """The refusal of a MultiHeadAttention named 'mha' called by ``call(layers, x)`` on a
    [6, 8] sequence."""
    sequence = keras.Input((6, 8), name="sequence")
    with pytest.raises(ImportRefused) as refused:
        import_keras(keras.Model(sequence, call(keras.layers, sequence)), Path("unused.toml"))
    return str(refused.value)


ATTENTION_REFUSALS = {
    "cross-attention": (
        lambda layers, x: layers.MultiHeadAttention(2, 4, name="mha")(x, layers.Dense(8, name="other")(x)),
        "query, value and key come from ['other', 'sequence']: the plan's attention is self-attention",
    ),
    "value_dim": (
        lambda layers, x: layers.MultiHeadAttention(2, 4, value_dim=8, name="mha")(x, x),
        "value_dim=8: the plan's attention gives values the keys' width",
    ),
    "dropout": (
        lambda layers, x: layers.MultiHeadAttention(2, 4, dropout=0.1, name="mha")(x, x),
        "dropout=0.1: the plan's attention drops no attention weights (add a dropout after it)",
    ),
    "a mask": (
        lambda layers, x: layers.MultiHeadAttention(2, 4, name="mha")(
            x, x, attention_mask=keras.ops.ones((1, 6, 6), dtype="bool")
        ),
        "called with attention_mask: the plan's attention takes no mask but causal (use_causal_mask=True) "
        "and a padding mask of token ids (not imported from Keras)",
    ),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_REFUSALS))
def test_attention_the_plan_cannot_compute_is_refused_in_one_line(case: str) -> None:
    build, reason = ATTENTION_REFUSALS[case]
    message = _attention_refusal(build)
    assert re.fullmatch(r"keras layer 'mha' \(MultiHeadAttention\): " + re.escape(reason), message), message


def test_a_dropout_of_whole_channels_is_refused() -> None:
    """``noise_shape=(None, 1, 1, 1)`` (a whole row) imports as ``per_row``; a mask shared
    over positions but not channels has no plan equivalent."""
    pixels = keras.Input((4, 4, 3))
    dropped = keras.layers.Dropout(0.2, noise_shape=(None, 1, 1, 3), name="drop")(pixels)
    with pytest.raises(ImportRefused) as refused:
        import_keras(keras.Model(pixels, dropped), Path("unused.toml"))
    assert str(refused.value) == (
        "keras layer 'drop' (Dropout): noise_shape=(None, 1, 1, 3): the plan's dropout drops single "
        "values or whole rows (noise_shape=(None, 1, ...)), not whole channels"
    )


def test_an_index_other_than_one_position_is_refused() -> None:
    sequence = keras.Input((5, 4))
    with pytest.raises(ImportRefused) as refused:
        import_keras(keras.Model(sequence, sequence[:, 1:3]), Path("unused.toml"))
    # the op's name counts the ops this process has made before it: get_item, get_item_1...
    assert re.fullmatch(
        r"keras layer 'get_item(_\d+)?' \(keras\.src\.ops\.numpy\.GetItem\): index \[:, 1:3\]: "
        r"the plan takes one position, x\[:, i\]",
        str(refused.value),
    )


def test_a_layer_without_a_plan_equivalent_is_refused_in_one_line(
    cli_in_process: Callable[..., Any], tmp_path: Path
) -> None:
    layers = keras.layers
    pixels = keras.Input((8, 8, 3))
    x = layers.Conv2D(4, 3, name="conv")(pixels)
    x = layers.GlobalMaxPooling2D(name="peak")(x)
    saved = tmp_path / "peaky.keras"
    keras.Model(pixels, layers.Dense(2, name="out")(x)).save(saved)
    result = cli_in_process("import", str(saved), "--out", str(tmp_path / "plan.toml"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "crosstrain: error: keras layer 'peak' (GlobalMaxPooling2D): the plan has no maximum over "
        "positions (what imports: docs/import.md)"
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["peaky.keras"]  # nothing written


def digits_convnet() -> Any:
    """A small Keras convnet for the 8x8 digits, batch norm included."""
    layers = keras.layers
    pixels = keras.Input((8, 8, 1), name="pixels")
    x = layers.Conv2D(8, 3, padding="same", name="conv")(pixels)
    x = layers.BatchNormalization(name="bn")(x)
    x = layers.Activation("relu", name="relu")(x)
    x = layers.MaxPooling2D(2, name="pool")(x)
    x = layers.Flatten(name="flat")(x)
    classes = layers.Dense(10, activation="softmax", name="classes")(x)
    return keras.Model(pixels, classes, name="digits_convnet")


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_imported_model_trains_from_its_weights_on_both_backends_alike(tmp_path: Path) -> None:
    """``crosstrain import model.keras`` (quiet, in a shell that does not quiet TensorFlow),
    then ``crosstrain run`` on torch and on tf: each
    starts from the Keras weights (its step-0 evaluation is the Keras model's own loss on the
    eval rows), and their first steps' losses agree as any plan's do."""
    model = moved_off_start(digits_convnet())
    saved = tmp_path / "convnet.keras"
    model.save(saved)
    plan_file = tmp_path / "convnet.toml"
    imported = run_cli("import", str(saved), "--out", str(plan_file), env=user_env())
    assert (imported.returncode, imported.stderr) == (0, "")  # not a line of TensorFlow's start-up log
    assert "final softmax ('classes', Dense) is left out" in imported.stdout
    assert (tmp_path / "init.safetensors").is_file()
    settings = ("--set", f"train.max_steps={STEPS}", "--set", "optimizer.lr=0.05")
    runs = {}
    for backend in ("torch", "tf"):
        runs[backend] = tmp_path / backend
        trained = run_cli(
            *QUIET, "run", str(plan_file), "--backend", backend, "--device", "cpu",
            "--out", str(runs[backend]), *settings,
        )  # fmt: skip
        assert trained.returncode == 0, trained.stderr
    plan = load_plan(plan_file, [setting for setting in settings if setting != "--set"])
    evaluation = load_datasets(plan).eval
    assert evaluation is not None
    logits = keras_logits(model, evaluation.x.reshape(-1, 8, 8, 1)).astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    keras_loss = np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(logits)), evaluation.y])
    for backend, run in runs.items():
        start = _records(run)[0]
        assert start["step"] == 0 and "eval" in start, start
        assert abs(start["eval"]["loss"] - keras_loss) <= 1e-5 * keras_loss, (backend, start, keras_loss)
    torch_losses, tf_losses = step_losses(runs["torch"]), step_losses(runs["tf"])
    assert len(torch_losses) == STEPS
    assert max_relative_difference(tf_losses, torch_losses) <= TRAIN_TOLERANCE
