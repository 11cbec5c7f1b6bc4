"""One small case per core layer type, and the torch reference's forward and gradients on
it: every backend's per-op parity test (crosstrain's tf, a third party's) compares against
the same numbers. :data:`PARITY_CASES` is every case: one per layer type (:data:`CASES`, by
its tag), and the other ways of writing layers (:data:`FORM_CASES`, by name). The layers are
written ``neutral.Dense(...)``: core's classes by their package, so a new one needs no import here.

A backend's test builds its model from :func:`case_plan`, loads :func:`case_weights`,
runs a training forward on ``inputs["x"]`` with the row mask, row positions and
:data:`STEP`, differentiates ``sum(outputs * inputs["upstream"])`` and hands the result to
:func:`assert_same_results` with the torch reference's (:func:`torch_results`). A core
layer type without a case here fails ``missing_cases()``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from crosstrain.core.model import layers as neutral
from crosstrain.core.model.layers import LAYER_TYPES, DType, Layer
from crosstrain.core.spec.plan import BlockSpec, ModelSpec, Plan

#: relative to the largest value of each compared array
TOLERANCE = 1e-5
#: the optimizer step the training forward runs at (dropout hashes it)
STEP = 7
ROWS = 5

#: a case: the input shape of one row, and the layers
Case = tuple[tuple[int, ...], tuple[Layer, ...]]

#: a layer type's tag -> its case: the type under test, with what it needs around it
CASES: dict[str, Case] = {
    "dense": ((5, 6), (neutral.Dense(units=4),)),  # on the last axis of a sequence
    "conv2d": ((7, 6, 3), (neutral.Conv2D(filters=4, kernel_size=(3, 2), strides=(2, 1)),)),
    "maxpool2d": ((6, 6, 3), (neutral.MaxPool2D(pool_size=3, strides=1),)),
    "avgpool2d": ((6, 5, 3), (neutral.AvgPool2D(pool_size=2),)),
    "global_avg_pool2d": ((4, 3, 5), (neutral.GlobalAvgPool2D(),)),
    "flatten": ((3, 4, 2), (neutral.Flatten(), neutral.Dense(units=3))),
    "conv1d": (
        (10, 4),
        (neutral.Conv1D(filters=6, kernel_size=3, strides=2, padding="same", groups=2),),
    ),  # pads (0, 1)
    "conv2d_transpose": (
        (3, 4, 3),
        (neutral.Conv2DTranspose(filters=2, kernel_size=(3, 4), strides=2, padding="same"),),
    ),
    "upsample2d": ((3, 4, 2), (neutral.UpSample2D(size=(2, 3), interpolation="bilinear"),)),
    "zero_pad2d": ((3, 4, 2), (neutral.ZeroPad2D(padding=((1, 0), (2, 1))),)),
    # of an image torch holds NCHW (after a convolution)
    "crop2d": (
        (5, 6, 2),
        (neutral.Conv2D(filters=3, kernel_size=1), neutral.Crop2D(cropping=((1, 0), (2, 1)))),
    ),
    # on the channels of an image (torch's NCHW made NHWC first), from a start other than 1
    "layer_scale": ((4, 4, 3), (neutral.Conv2D(filters=3, kernel_size=1), neutral.LayerScale(initial=0.5))),
    "sigmoid": ((10,), (neutral.Sigmoid(),)),
    "silu": ((10,), (neutral.SiLU(),)),
    # on the channels of an image that torch holds NCHW (after a convolution)
    "softmax": ((4, 3, 5), (neutral.Conv2D(filters=4, kernel_size=1), neutral.Softmax())),
    "relu6": ((10,), (neutral.Rescale(scale=4.0), neutral.ReLU6())),  # inputs past 6 too
    "hard_swish": ((10,), (neutral.Rescale(scale=3.0), neutral.HardSwish())),  # past -3 and 3 too
    # a squeeze-and-excite gate: [1, 1, channels] broadcast over an NCHW image
    "multiply": (
        (4, 4, 3),
        (
            neutral.Conv2D(filters=3, kernel_size=1, name="x"),
            neutral.Mean(axes=(0, 1), keepdims=True),
            neutral.Sigmoid(name="gate"),
            neutral.Multiply(inputs=("x", "gate")),
        ),
    ),
    "reshape": ((3, 4, 2), (neutral.Conv2D(filters=2, kernel_size=1), neutral.Reshape(target_shape=(-1, 4)))),
    "transpose": ((5, 6), (neutral.Transpose(perm=(1, 0)), neutral.Dense(units=3))),
    # of an NCHW image
    "mean": ((4, 3, 5), (neutral.Conv2D(filters=4, kernel_size=1), neutral.Mean(axes=(0, 1)))),
    "rescale": ((10,), (neutral.Rescale(scale=0.5, offset=-1.0),)),
    "relu": ((10,), (neutral.ReLU(),)),
    "leaky_relu": ((10,), (neutral.LeakyReLU(negative_slope=0.2),)),
    "gelu": ((10,), (neutral.GELU(),)),
    "tanh": ((10,), (neutral.Tanh(),)),
    "dropout": ((4, 10), (neutral.Dropout(rate=0.3),)),
    "layernorm": ((6, 8), (neutral.LayerNorm(eps=1e-3),)),
    "batchnorm": ((4, 4, 3), (neutral.BatchNorm(momentum=0.7),)),
    "embedding": ((6,), (neutral.Embedding(vocab_size=11, units=4),)),
    "position_embedding": ((6, 4), (neutral.PositionEmbedding(),)),
    "attention": ((6, 8), (neutral.Attention(heads=2, causal=True),)),
    "rmsnorm": ((6, 8), (neutral.RMSNorm(epsilon=1e-3),)),
    "class_token": ((5, 4), (neutral.ClassToken(),)),
    # ViT's head: the class token, x[:, 0]
    "take": ((5, 4), (neutral.ClassToken(), neutral.Take(index=0))),
    # the mask of token ids 3 (rows 1, 2 and 4 of case_inputs hold some, row 2 at position 0,
    # which a causal query 0 then attends to alone), read by attention as its second input
    "padding_mask": (
        (6,),
        (
            neutral.Embedding(vocab_size=11, units=8, name="tokens"),
            neutral.PaddingMask(pad_id=3, inputs=("input",), name="mask"),
            neutral.Attention(heads=2, causal=True, inputs=("tokens", "mask")),
        ),
    ),
    "add": (
        (5,),
        (
            neutral.Dense(units=4, name="a"),
            neutral.Dense(units=4, inputs=("input",), name="b"),
            neutral.Add(inputs=("a", "b", "a")),
        ),
    ),
    "concat": (
        (5,),
        (
            neutral.Dense(units=3, name="a"),
            neutral.Dense(units=2, inputs=("input",), name="b"),
            neutral.Concat(inputs=("b", "a")),
        ),
    ),
    "block": ((5,), (neutral.Block(block="twice", repeat=2),)),
}
_BLOCKS = {"twice": BlockSpec(layers=(neutral.Dense(units=5), neutral.Tanh()))}
#: ways of writing layers beyond one case per type, by name: Keras's ``activation =`` on
#: dense and conv2d (core writes it out as the activation layer after it)
FORM_CASES: dict[str, Case] = {
    "dense_activation": (
        (5, 6),
        (neutral.Dense(units=4, activation="relu"), neutral.Dense(units=3, activation="gelu")),
    ),
    # Llama's attention: grouped keys and values, rotary positions, no biases
    "attention_grouped_rotary": (
        (6, 16),
        (
            neutral.Attention(
                heads=4, kv_heads=2, causal=True, rotary=True, rotary_base=500.0, use_bias=False
            ),
        ),
    ),
    "attention_padding_mask": (
        (6,),
        (
            neutral.Embedding(vocab_size=11, units=8, name="tokens"),
            neutral.PaddingMask(pad_id=3, inputs=("input",), name="mask"),
            neutral.Attention(heads=2, inputs=("tokens", "mask")),
        ),
    ),
    # GPT-2's output: the dense's kernel is the embedding's table, transposed (gradients of both uses)
    "dense_tied": (
        (6,),
        (
            neutral.Embedding(vocab_size=11, units=4, name="tokens"),
            neutral.LayerNorm(),
            neutral.Dense(units=11, tie="tokens"),
        ),
    ),
    "conv2d_activation": (
        (7, 6, 3),
        (neutral.Conv2D(filters=4, kernel_size=(3, 2), activation="leaky_relu"),),
    ),
    # TensorFlow's 'same': the extra row or column at the bottom or right (8 at stride 2, an
    # even kernel), symmetric where the total is even (7 at stride 2)
    "conv2d_same_strided": (
        (8, 7, 3),
        (
            neutral.Conv2D(filters=4, kernel_size=3, strides=2, padding="same"),
            neutral.Conv2D(filters=3, kernel_size=(4, 3), padding="same", activation="relu6"),
        ),
    ),
    "conv2d_depthwise": (
        (8, 8, 4),
        (neutral.Conv2D(filters=8, kernel_size=3, strides=2, padding="same", groups=4),),
    ),
    "conv2d_grouped_dilated": (
        (9, 8, 4),
        (neutral.Conv2D(filters=6, kernel_size=3, padding="same", dilation=2, groups=2),),
    ),
    # a kernel narrower than the stride: zero columns after the transposed convolution's end
    "conv2d_transpose_valid": (
        (3, 4, 3),
        (neutral.Conv2DTranspose(filters=2, kernel_size=(3, 1), strides=2),),
    ),
    "upsample2d_nearest": (
        (3, 4, 2),
        (neutral.Conv2D(filters=2, kernel_size=1), neutral.UpSample2D(size=(3, 2))),
    ),
    "keras_activations": (
        (5,),
        (
            neutral.Dense(units=6, activation="silu"),
            neutral.Dense(units=6, activation="hard_swish"),
            neutral.Dense(units=6, activation="relu6"),
            neutral.Dense(units=4, activation="sigmoid"),
        ),
    ),
    # stochastic depth: each row of an NCHW image kept or dropped whole (rate 0.5: 5 rows at
    # step 7 keep some and drop some)
    "dropout_per_row": (
        (4, 3, 5),
        (neutral.Conv2D(filters=4, kernel_size=1), neutral.Dropout(rate=0.5, per_row=True)),
    ),
    # TensorFlow's 'same' on pools: pads (1, 1) on height and (0, 1) on width; max never
    # takes the padding, avg divides by the real cells a window covers
    "maxpool2d_same": ((7, 6, 3), (neutral.MaxPool2D(pool_size=3, strides=2, padding="same"),)),
    "avgpool2d_same": ((7, 6, 3), (neutral.AvgPool2D(pool_size=3, strides=2, padding="same"),)),
    # Keras's scale=False (InceptionV3's) and center=False: no scale or offset weight
    "batchnorm_unscaled_uncentered": (
        (4, 4, 3),
        (neutral.BatchNorm(momentum=0.7, scale=False), neutral.BatchNorm(center=False)),
    ),
    # Keras's per-channel Normalization (EfficientNetV2's, ConvNeXt's) on an NCHW image
    "rescale_per_channel": (
        (4, 3, 5),
        (
            neutral.Conv2D(filters=4, kernel_size=1),
            neutral.Rescale(scale=(0.5, 2.0, -1.0, 3.0), offset=(0.1, -0.2, 0.3, 0.0)),
        ),
    ),
    "take_from_the_end": ((5, 4), (neutral.Dense(units=3), neutral.Take(index=-2))),
    # NCHW to [w]
    "mean_to_a_sequence": ((4, 3, 5), (neutral.Conv2D(filters=4, kernel_size=1), neutral.Mean(axes=(0, -1)))),
    "conv1d_dilated_activation": (
        (10, 3),
        (neutral.Conv1D(filters=4, kernel_size=3, dilation=2, activation="swish"),),
    ),
}
#: every case a backend's per-op parity test runs: a layer type's tag, or a form's name
PARITY_CASES: list[str] = [*CASES, *FORM_CASES]


def case_id(kind: str) -> str:
    """A case's test id: the layer type's tag, or the form's name (the case's own key)."""
    return kind


def missing_cases() -> list[str]:
    """Core layer types with no case: a new type must bring one."""
    return sorted(set(LAYER_TYPES) - set(CASES))


def case_plan(kind: str) -> Plan:
    """The plan of a case: a layer type's tag (a key of :data:`CASES`) or a form's name."""
    input_shape, layers = CASES[kind] if kind in CASES else FORM_CASES[kind]
    dtype: DType = "int32" if layers[0].accepts == ("int32",) else "float32"  # token ids
    blocks = dict(_BLOCKS) if kind == neutral.Block.type else {}
    return Plan(
        model=ModelSpec(input_shape=input_shape, input_dtype=dtype, layers=layers, blocks=blocks), seed=4
    )


def case_inputs(plan: Plan) -> dict[str, np.ndarray]:
    """``x``, the row mask (one padding row: batch norm must skip it), row positions and the
    upstream gradient."""
    rng = np.random.default_rng(1)
    shape = (ROWS, *plan.model.input_shape)
    if plan.model.input_dtype == "int32":
        x = rng.integers(0, 11, size=shape).astype(np.int32)
    else:
        x = rng.normal(size=shape).astype(np.float32)
    return {
        "x": x,
        "weight": np.array([1, 1, 0, 1, 1], np.float32),
        "rows": np.arange(8, 8 + ROWS, dtype=np.int64),
        "upstream": rng.normal(size=(ROWS, *plan.model.graph().output_shape)).astype(np.float32),
    }


def case_weights(plan: Plan) -> dict[str, np.ndarray]:
    """Initial weights moved off their start (biases and offsets are not all zero)."""
    rng = np.random.default_rng(2)
    initial = plan.model.graph().init_weights(plan.seed)
    return {
        name: value + rng.normal(size=value.shape).astype(np.float32) * 0.1 for name, value in initial.items()
    }


def trainable_names(plan: Plan) -> list[str]:
    return [name for name, spec in plan.model.graph().weight_specs().items() if spec.trainable]


@attrs.frozen(eq=False)
class CaseResults:
    """What a backend computed on a case: outputs, d/d input (None for token ids), d/d each
    trainable neutral weight, and every neutral weight after the forward (running statistics)."""

    outputs: np.ndarray
    input_gradient: np.ndarray | None
    weight_gradients: Mapping[str, np.ndarray]
    weights_after: Mapping[str, np.ndarray]


def assert_same_results(actual: CaseResults, expected: CaseResults) -> None:
    """Equal within :data:`TOLERANCE` of each array's largest value; a gradient that is zero
    in exact arithmetic (attention's key bias: softmax ignores a shift shared by all keys) is
    rounding noise on both sides, so gradients are measured against the largest one."""
    _close(actual.outputs, expected.outputs, "outputs")
    assert (actual.input_gradient is None) == (expected.input_gradient is None)
    gradients = dict(expected.weight_gradients)
    if expected.input_gradient is not None:
        gradients["input"] = expected.input_gradient
    scale = max((float(np.abs(value).max()) for value in gradients.values()), default=0.0)
    assert sorted(actual.weight_gradients) == sorted(expected.weight_gradients)
    for name, value in expected.weight_gradients.items():
        _close(actual.weight_gradients[name], value, f"d/d {name}", scale)
    if expected.input_gradient is not None:
        assert actual.input_gradient is not None
        _close(actual.input_gradient, expected.input_gradient, "d/d input", scale)
    assert sorted(actual.weights_after) == sorted(expected.weights_after)
    for name, value in expected.weights_after.items():
        _close(actual.weights_after[name], value, f"{name} after the forward")


def _close(actual: np.ndarray, expected: np.ndarray, name: str, floor: float = 0.0) -> None:
    scale = max(float(np.abs(expected).max()), floor, 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE * scale, err_msg=name)


def torch_results(plan: Plan) -> CaseResults:
    """The torch backend's results on a case: the reference."""
    import torch

    from crosstrain.backends.torch.model import build_module, load_neutral, neutral_state

    inputs = case_inputs(plan)
    module = build_module(plan)
    load_neutral(module, plan, case_weights(plan))
    module.train()
    x = torch.from_numpy(inputs["x"])
    if x.is_floating_point():
        x.requires_grad_()
    outputs = module(x, torch.from_numpy(inputs["weight"]), torch.from_numpy(inputs["rows"]), STEP)
    (outputs * torch.from_numpy(inputs["upstream"])).sum().backward()
    after = neutral_state(module, plan)
    with torch.no_grad():  # the gradients in the weights' place: neutral_state lays them out
        for parameter in module.parameters():
            assert parameter.grad is not None
            parameter.copy_(parameter.grad)
    trainable = set(trainable_names(plan))
    gradients = {name: value for name, value in neutral_state(module, plan).items() if name in trainable}
    input_gradient = None if x.grad is None else x.grad.numpy()
    return CaseResults(outputs.detach().numpy(), input_gradient, gradients, after)
