"""Every layer type of core's vocabulary: forward and gradients on torch equal tf's, from the
same numpy weights and inputs, in training mode (batch norm on a row mask, dropout at a step).

One case per core layer type; a new type without a case here fails
``test_every_core_layer_type_has_a_case``.
"""

from __future__ import annotations

import numpy as np
import pytest

from crosstrain.core.layers import (
    GELU,
    LAYER_TYPES,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Block,
    Concat,
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    Layer,
    LayerNorm,
    MaxPool2D,
    PositionEmbedding,
    ReLU,
    Tanh,
)
from crosstrain.core.plan import BlockSpec, ModelSpec, Plan

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross

#: relative to the largest value of each compared array
TOLERANCE = 1e-5

# layer type -> (input shape, layers): the type under test, with what it needs around it
CASES: dict[type[Layer], tuple[tuple[int, ...], tuple[Layer, ...]]] = {
    Dense: ((5, 6), (Dense(units=4),)),  # on the last axis of a sequence
    Conv2D: ((7, 6, 3), (Conv2D(filters=4, kernel_size=(3, 2), strides=(2, 1)),)),
    MaxPool2D: ((6, 6, 3), (MaxPool2D(pool_size=3, strides=1),)),
    AvgPool2D: ((6, 5, 3), (AvgPool2D(pool_size=2),)),
    GlobalAvgPool2D: ((4, 3, 5), (GlobalAvgPool2D(),)),
    Flatten: ((3, 4, 2), (Flatten(), Dense(units=3))),
    ReLU: ((10,), (ReLU(),)),
    GELU: ((10,), (GELU(),)),
    Tanh: ((10,), (Tanh(),)),
    Dropout: ((4, 10), (Dropout(rate=0.3),)),
    LayerNorm: ((6, 8), (LayerNorm(eps=1e-3),)),
    BatchNorm: ((4, 4, 3), (BatchNorm(momentum=0.7),)),
    Embedding: ((6,), (Embedding(vocab_size=11, units=4),)),
    PositionEmbedding: ((6, 4), (PositionEmbedding(),)),
    Attention: ((6, 8), (Attention(heads=2, causal=True),)),
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
BLOCKS = {"twice": (Dense(units=5), Tanh())}


def test_every_core_layer_type_has_a_case() -> None:
    assert set(CASES) == set(LAYER_TYPES.values())


def _plan(kind: type[Layer]) -> Plan:
    input_shape, layers = CASES[kind]
    dtype = "int32" if kind is Embedding else "float32"
    blocks = {"twice": BlockSpec(layers=BLOCKS["twice"])} if kind is Block else {}
    return Plan(
        model=ModelSpec(input_shape=input_shape, input_dtype=dtype, layers=layers, blocks=blocks), seed=4
    )


def _inputs(plan: Plan) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (5, *plan.model.input_shape)
    x = (
        rng.integers(0, 11, size=shape).astype(np.int32)
        if plan.model.input_dtype == "int32"
        else rng.normal(size=shape).astype(np.float32)
    )
    graph = plan.model.graph()
    weights = {
        name: value + rng.normal(size=value.shape).astype(np.float32) * 0.1
        for name, value in graph.init_weights(plan.seed).items()
    }
    return {
        "x": x,
        "weight": np.array([1, 1, 0, 1, 1], np.float32),  # a padding row: batch norm must skip it
        "rows": np.array([8, 9, 10, 11, 12], np.int64),
        "upstream": rng.normal(size=(5, *graph.output_shape)).astype(np.float32),
        **{f"w:{name}": value for name, value in weights.items()},
    }


def _weights(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name[2:]: value for name, value in arrays.items() if name.startswith("w:")}


STEP = 7


def _torch(plan: Plan, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Outputs and d(sum(outputs * upstream)) by input and by each neutral weight."""
    from crosstrain.backends.torch.model import build_module, load_neutral, neutral_state

    module = build_module(plan)
    load_neutral(module, plan, _weights(arrays))
    module.train()
    x = torch.from_numpy(arrays["x"])
    if x.is_floating_point():
        x.requires_grad_()
    weight, rows = torch.from_numpy(arrays["weight"]), torch.from_numpy(arrays["rows"])
    outputs = module(x, weight, rows, STEP)
    (outputs * torch.from_numpy(arrays["upstream"])).sum().backward()
    grads = {"input": x.grad.numpy()} if x.grad is not None else {}
    trained = neutral_state(module, plan)  # running statistics after the forward
    with torch.no_grad():  # the gradients in the weights' place: neutral_state lays them out
        for parameter in module.parameters():
            parameter.copy_(parameter.grad)
    grads.update({f"grad:{k}": v for k, v in neutral_state(module, plan).items() if k in _trainable(plan)})
    grads.update({f"after:{k}": v for k, v in trained.items()})
    return outputs.detach().numpy(), grads


def _tf(plan: Plan, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    from crosstrain.backends.tf.model import build_model, load_neutral, neutral_state

    model = build_model(plan)
    load_neutral(model, plan, _weights(arrays))
    x = tf.constant(arrays["x"])
    variables = model.neutral_variables()
    trainable = {name: variables[name] for name in _trainable(plan)}
    with tf.GradientTape(persistent=True) as tape:
        if x.dtype.is_floating:
            tape.watch(x)
        outputs = model(x, training=True, weight=arrays["weight"], rows=arrays["rows"], step=np.int64(STEP))
        total = tf.reduce_sum(outputs * arrays["upstream"])
    grads = {"input": tape.gradient(total, x).numpy()} if x.dtype.is_floating else {}
    for name, variable in trainable.items():
        grads[f"grad:{name}"] = tf.convert_to_tensor(tape.gradient(total, variable)).numpy()
    grads.update({f"after:{k}": v for k, v in neutral_state(model, plan).items()})
    return outputs.numpy(), grads


def _trainable(plan: Plan) -> list[str]:
    return [name for name, spec in plan.model.graph().weight_specs().items() if spec.trainable]


@pytest.mark.parametrize("kind", list(CASES), ids=lambda kind: kind.type)
def test_forward_and_gradients_agree(kind: type[Layer]) -> None:
    plan = _plan(kind)
    arrays = _inputs(plan)
    torch_out, torch_grads = _torch(plan, arrays)
    tf_out, tf_grads = _tf(plan, arrays)
    _close(tf_out, torch_out, "outputs")
    assert sorted(tf_grads) == sorted(torch_grads)
    # a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    # shift shared by all keys) is rounding noise on both sides: measure every gradient
    # against the model's largest one
    gradient_scale = max(float(np.abs(v).max()) for k, v in torch_grads.items() if not k.startswith("after:"))
    for name, expected in torch_grads.items():
        floor = 0.0 if name.startswith("after:") else gradient_scale
        _close(tf_grads[name], expected, name, floor)
    if kind is Dropout:  # the masks really drop something, the same somethings
        assert 0.1 < np.mean(torch_out == 0) < 0.5


def _close(actual: np.ndarray, expected: np.ndarray, name: str, floor: float = 0.0) -> None:
    scale = max(float(np.abs(expected).max()), floor, 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE * scale, err_msg=name)
