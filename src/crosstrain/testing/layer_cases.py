"""One small case per core layer type, and the torch reference's forward and gradients on
it: every backend's per-op parity test (crosstrain's tf, a third party's) compares against
the same numbers. :data:`PARITY_CASES` is every case: one per layer type (:data:`CASES`),
and the other ways of writing layers (:data:`FORM_CASES`).

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

from crosstrain.core.model.layers import (
    GELU,
    LAYER_TYPES,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Block,
    ClassToken,
    Concat,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    Dense,
    Dropout,
    DType,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    HardSwish,
    Layer,
    LayerNorm,
    LayerScale,
    LeakyReLU,
    MaxPool2D,
    Mean,
    Multiply,
    PaddingMask,
    PositionEmbedding,
    ReLU,
    ReLU6,
    Rescale,
    Reshape,
    RMSNorm,
    Sigmoid,
    SiLU,
    Softmax,
    Take,
    Tanh,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.spec.plan import BlockSpec, ModelSpec, Plan

#: relative to the largest value of each compared array
TOLERANCE = 1e-5
#: the optimizer step the training forward runs at (dropout hashes it)
STEP = 7
ROWS = 5

# layer type -> (input shape, layers): the type under test, with what it needs around it
CASES: dict[type[Layer], tuple[tuple[int, ...], tuple[Layer, ...]]] = {
    Dense: ((5, 6), (Dense(units=4),)),  # on the last axis of a sequence
    Conv2D: ((7, 6, 3), (Conv2D(filters=4, kernel_size=(3, 2), strides=(2, 1)),)),
    MaxPool2D: ((6, 6, 3), (MaxPool2D(pool_size=3, strides=1),)),
    AvgPool2D: ((6, 5, 3), (AvgPool2D(pool_size=2),)),
    GlobalAvgPool2D: ((4, 3, 5), (GlobalAvgPool2D(),)),
    Flatten: ((3, 4, 2), (Flatten(), Dense(units=3))),
    Conv1D: (
        (10, 4),
        (Conv1D(filters=6, kernel_size=3, strides=2, padding="same", groups=2),),
    ),  # pads (0, 1)
    Conv2DTranspose: (
        (3, 4, 3),
        (Conv2DTranspose(filters=2, kernel_size=(3, 4), strides=2, padding="same"),),
    ),
    UpSample2D: ((3, 4, 2), (UpSample2D(size=(2, 3), interpolation="bilinear"),)),
    ZeroPad2D: ((3, 4, 2), (ZeroPad2D(padding=((1, 0), (2, 1))),)),
    # of an image torch holds NCHW (after a convolution)
    Crop2D: ((5, 6, 2), (Conv2D(filters=3, kernel_size=1), Crop2D(cropping=((1, 0), (2, 1))))),
    # on the channels of an image (torch's NCHW made NHWC first), from a start other than 1
    LayerScale: ((4, 4, 3), (Conv2D(filters=3, kernel_size=1), LayerScale(initial=0.5))),
    Sigmoid: ((10,), (Sigmoid(),)),
    SiLU: ((10,), (SiLU(),)),
    # on the channels of an image that torch holds NCHW (after a convolution)
    Softmax: ((4, 3, 5), (Conv2D(filters=4, kernel_size=1), Softmax())),
    ReLU6: ((10,), (Rescale(scale=4.0), ReLU6())),  # inputs past 6 too
    HardSwish: ((10,), (Rescale(scale=3.0), HardSwish())),  # past -3 and 3 too
    # a squeeze-and-excite gate: [1, 1, channels] broadcast over an NCHW image
    Multiply: (
        (4, 4, 3),
        (
            Conv2D(filters=3, kernel_size=1, name="x"),
            Mean(axes=(0, 1), keepdims=True),
            Sigmoid(name="gate"),
            Multiply(inputs=("x", "gate")),
        ),
    ),
    Reshape: ((3, 4, 2), (Conv2D(filters=2, kernel_size=1), Reshape(target_shape=(-1, 4)))),
    Transpose: ((5, 6), (Transpose(perm=(1, 0)), Dense(units=3))),
    Mean: ((4, 3, 5), (Conv2D(filters=4, kernel_size=1), Mean(axes=(0, 1)))),  # of an NCHW image
    Rescale: ((10,), (Rescale(scale=0.5, offset=-1.0),)),
    ReLU: ((10,), (ReLU(),)),
    LeakyReLU: ((10,), (LeakyReLU(negative_slope=0.2),)),
    GELU: ((10,), (GELU(),)),
    Tanh: ((10,), (Tanh(),)),
    Dropout: ((4, 10), (Dropout(rate=0.3),)),
    LayerNorm: ((6, 8), (LayerNorm(eps=1e-3),)),
    BatchNorm: ((4, 4, 3), (BatchNorm(momentum=0.7),)),
    Embedding: ((6,), (Embedding(vocab_size=11, units=4),)),
    PositionEmbedding: ((6, 4), (PositionEmbedding(),)),
    Attention: ((6, 8), (Attention(heads=2, causal=True),)),
    RMSNorm: ((6, 8), (RMSNorm(epsilon=1e-3),)),
    ClassToken: ((5, 4), (ClassToken(),)),
    # ViT's head: the class token, x[:, 0]
    Take: ((5, 4), (ClassToken(), Take(index=0))),
    # the mask of token ids 3 (rows 1, 2 and 4 of case_inputs hold some, row 2 at position 0,
    # which a causal query 0 then attends to alone), read by attention as its second input
    PaddingMask: (
        (6,),
        (
            Embedding(vocab_size=11, units=8, name="tokens"),
            PaddingMask(pad_id=3, inputs=("input",), name="mask"),
            Attention(heads=2, causal=True, inputs=("tokens", "mask")),
        ),
    ),
    Add: (
        (5,),
        (Dense(units=4, name="a"), Dense(units=4, inputs=("input",), name="b"), Add(inputs=("a", "b", "a"))),
    ),
    Concat: (
        (5,),
        (Dense(units=3, name="a"), Dense(units=2, inputs=("input",), name="b"), Concat(inputs=("b", "a"))),
    ),
    Block: ((5,), (Block(block="twice", repeat=2),)),
}
_BLOCKS = {"twice": BlockSpec(layers=(Dense(units=5), Tanh()))}
#: ways of writing layers beyond one case per type, by name: Keras's ``activation =`` on
#: dense and conv2d (core writes it out as the activation layer after it)
FORM_CASES: dict[str, tuple[tuple[int, ...], tuple[Layer, ...]]] = {
    "dense_activation": ((5, 6), (Dense(units=4, activation="relu"), Dense(units=3, activation="gelu"))),
    # Llama's attention: grouped keys and values, rotary positions, no biases
    "attention_grouped_rotary": (
        (6, 16),
        (Attention(heads=4, kv_heads=2, causal=True, rotary=True, rotary_base=500.0, use_bias=False),),
    ),
    "attention_padding_mask": (
        (6,),
        (
            Embedding(vocab_size=11, units=8, name="tokens"),
            PaddingMask(pad_id=3, inputs=("input",), name="mask"),
            Attention(heads=2, inputs=("tokens", "mask")),
        ),
    ),
    # GPT-2's output: the dense's kernel is the embedding's table, transposed (gradients of both uses)
    "dense_tied": (
        (6,),
        (Embedding(vocab_size=11, units=4, name="tokens"), LayerNorm(), Dense(units=11, tie="tokens")),
    ),
    "conv2d_activation": ((7, 6, 3), (Conv2D(filters=4, kernel_size=(3, 2), activation="leaky_relu"),)),
    # TensorFlow's 'same': the extra row or column at the bottom or right (8 at stride 2, an
    # even kernel), symmetric where the total is even (7 at stride 2)
    "conv2d_same_strided": (
        (8, 7, 3),
        (
            Conv2D(filters=4, kernel_size=3, strides=2, padding="same"),
            Conv2D(filters=3, kernel_size=(4, 3), padding="same", activation="relu6"),
        ),
    ),
    "conv2d_depthwise": ((8, 8, 4), (Conv2D(filters=8, kernel_size=3, strides=2, padding="same", groups=4),)),
    "conv2d_grouped_dilated": (
        (9, 8, 4),
        (Conv2D(filters=6, kernel_size=3, padding="same", dilation=2, groups=2),),
    ),
    # a kernel narrower than the stride: zero columns after the transposed convolution's end
    "conv2d_transpose_valid": ((3, 4, 3), (Conv2DTranspose(filters=2, kernel_size=(3, 1), strides=2),)),
    "upsample2d_nearest": ((3, 4, 2), (Conv2D(filters=2, kernel_size=1), UpSample2D(size=(3, 2)))),
    "keras_activations": (
        (5,),
        (
            Dense(units=6, activation="silu"),
            Dense(units=6, activation="hard_swish"),
            Dense(units=6, activation="relu6"),
            Dense(units=4, activation="sigmoid"),
        ),
    ),
    # stochastic depth: each row of an NCHW image kept or dropped whole (rate 0.5: 5 rows at
    # step 7 keep some and drop some)
    "dropout_per_row": ((4, 3, 5), (Conv2D(filters=4, kernel_size=1), Dropout(rate=0.5, per_row=True))),
    # TensorFlow's 'same' on pools: pads (1, 1) on height and (0, 1) on width; max never
    # takes the padding, avg divides by the real cells a window covers
    "maxpool2d_same": ((7, 6, 3), (MaxPool2D(pool_size=3, strides=2, padding="same"),)),
    "avgpool2d_same": ((7, 6, 3), (AvgPool2D(pool_size=3, strides=2, padding="same"),)),
    # Keras's scale=False (InceptionV3's) and center=False: no scale or offset weight
    "batchnorm_unscaled_uncentered": (
        (4, 4, 3),
        (BatchNorm(momentum=0.7, scale=False), BatchNorm(center=False)),
    ),
    # Keras's per-channel Normalization (EfficientNetV2's, ConvNeXt's) on an NCHW image
    "rescale_per_channel": (
        (4, 3, 5),
        (
            Conv2D(filters=4, kernel_size=1),
            Rescale(scale=(0.5, 2.0, -1.0, 3.0), offset=(0.1, -0.2, 0.3, 0.0)),
        ),
    ),
    "take_from_the_end": ((5, 4), (Dense(units=3), Take(index=-2))),
    "mean_to_a_sequence": ((4, 3, 5), (Conv2D(filters=4, kernel_size=1), Mean(axes=(0, -1)))),  # NCHW to [w]
    "conv1d_dilated_activation": (
        (10, 3),
        (Conv1D(filters=4, kernel_size=3, dilation=2, activation="swish"),),
    ),
}
#: every case a backend's per-op parity test runs: a layer type, or a form's name
PARITY_CASES: list[type[Layer] | str] = [*CASES, *FORM_CASES]


def case_id(kind: type[Layer] | str) -> str:
    """A case's test id: the layer type's tag, or the form's name."""
    return kind if isinstance(kind, str) else kind.type


def missing_cases() -> list[str]:
    """Core layer types with no case: a new type must bring one."""
    return sorted(kind.type for kind in set(LAYER_TYPES.values()) - set(CASES))


def case_plan(kind: type[Layer] | str) -> Plan:
    input_shape, layers = FORM_CASES[kind] if isinstance(kind, str) else CASES[kind]
    dtype: DType = "int32" if layers[0].accepts == ("int32",) else "float32"  # token ids
    blocks = dict(_BLOCKS) if kind is Block else {}
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
