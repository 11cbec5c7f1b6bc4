"""The torch backend's image layout (backends/torch/layout.py): which order each image is
kept in, how often it is permuted, and the rewrites of the forward's steps (a zero padding
folded into its reader, an activation run after the max pool that reads it), each
computing what the plain order computes."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from crosstrain.core.model.layers import (
    GELU,
    Add,
    BatchNorm,
    Concat,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool2D,
    Layer,
    MaxPool2D,
    ReLU,
    ReLU6,
    ZeroPad2D,
)
from crosstrain.core.spec.plan import ModelSpec, Plan

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.layers import LAYERS  # noqa: E402
from crosstrain.backends.torch.layout import activations_pooled_first, folded_paddings  # noqa: E402
from crosstrain.backends.torch.model import build_module, load_neutral, neutral_state  # noqa: E402
from crosstrain.backends.torch.nodes import Order  # noqa: E402

pytestmark = pytest.mark.torch


# conv -> relu -> pool -> conv -> add -> global pool: one run of layout-aware nodes
_RUN = (
    Conv2D(filters=4, kernel_size=3, padding="same"),
    ReLU(),
    MaxPool2D(pool_size=2, name="pool"),
    Conv2D(filters=4, kernel_size=3, padding="same", name="conv"),
    Add(inputs=("pool", "conv")),
    GlobalAvgPool2D(),
)
# every order-aware node in NCHW (batch norm, dropout, concat), and an image read in both
# orders: concat's output goes on in NCHW (gelu) and to flatten in NHWC
_MIXED = (
    Conv2D(filters=4, kernel_size=3, padding="same"),
    BatchNorm(momentum=0.5),
    ReLU(),
    MaxPool2D(pool_size=2, name="pool"),
    Conv2D(filters=4, kernel_size=3, padding="same"),
    Dropout(rate=0.3, name="drop"),
    Add(inputs=("pool", "drop"), name="sum"),
    Concat(inputs=("sum", "pool"), name="joined"),
    GELU(),
    GlobalAvgPool2D(name="pooled"),
    Flatten(inputs=("joined",)),
    Dense(units=3, name="flat"),
    Concat(inputs=("pooled", "flat")),
    Dense(units=5),
)


def _image_plan(layers: tuple[Layer, ...]) -> Plan:
    return Plan(model=ModelSpec(input_shape=(8, 8, 3), layers=layers), seed=3)


def _nhwc_module(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The module as it was before images ran in NCHW: every node but a convolution and a
    pooling reads NHWC, so each of those permutes its input to NCHW and its output back."""
    with monkeypatch.context() as patched:
        for kind, row in LAYERS.items():
            if row.order is not Order.CHANNELS_FIRST:
                patched.setitem(LAYERS, kind, attrs.evolve(row, order=Order.NEUTRAL))
        return build_module(plan)


def _train_forward(module: Any, plan: Plan) -> dict[str, np.ndarray]:
    """Outputs, d/d input and d/d every parameter of ``sum(outputs * upstream)`` in training
    (a padding row, dropout at step 7), and the state after it (batch norm's statistics)."""
    rng = np.random.default_rng(5)
    load_neutral(module, plan, {k: v + 0.1 for k, v in plan.model.graph().init_weights(plan.seed).items()})
    x = torch.from_numpy(rng.normal(size=(6, 8, 8, 3)).astype(np.float32)).requires_grad_()
    weight, rows = torch.tensor([1, 1, 0, 1, 1, 1.0]), torch.arange(10, 16)
    outputs = module(x, weight, rows, 7)
    upstream = torch.from_numpy(rng.normal(size=tuple(outputs.shape)).astype(np.float32))
    (outputs * upstream).sum().backward()
    results = {"outputs": outputs.detach().numpy(), "d/d input": x.grad.numpy()}
    results |= {f"d/d {name}": p.grad.numpy() for name, p in module.named_parameters()}
    return results | {f"after {name}": value for name, value in neutral_state(module, plan).items()}


def _assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """Each array within 2e-6 of its scale; a gradient's scale is the model's largest: a
    gradient that is zero in exact arithmetic (a convolution's bias before batch norm) is
    rounding noise, which another memory layout sums in another order."""
    assert sorted(actual) == sorted(expected)
    largest_gradient = max(float(np.abs(v).max()) for k, v in expected.items() if k.startswith("d/d"))
    for name, value in expected.items():
        scale = largest_gradient if name.startswith("d/d") else float(np.abs(value).max())
        np.testing.assert_allclose(actual[name], value, rtol=0, atol=2e-6 * scale, err_msg=name)


def test_a_run_of_image_nodes_stays_nchw_and_permutes_only_on_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _image_plan(_RUN)
    module = build_module(plan)
    # one permutation (the NHWC input to NCHW); the global pool's output has no order
    assert module.layout.permutations == 1
    assert module.layout.channels_first == (True,) * len(_RUN)
    before = _nhwc_module(plan, monkeypatch)
    # into and out of each convolution and pooling (the pooling feeds the second directly)
    assert before.layout.permutations == 5
    images: dict[str, torch.Tensor] = {}
    for key, node in module.nodes.items():
        node.register_forward_hook(lambda node, args, output, key=key: images.setdefault(key, output))
    _assert_same(_train_forward(module, plan), _train_forward(before, plan))
    graph = plan.model.graph()
    pooled = activations_pooled_first(graph, {})  # the ReLU activates its pool's output
    for node in graph.nodes[:-1]:  # each image between the nodes: NCHW, laid out channels-last
        height, width, channels = graph.nodes[pooled.get(node.index, node.index)].output_shape
        image = images[node.path]
        assert image.shape == (6, channels, height, width), node.path
        assert image.is_contiguous(memory_format=torch.channels_last), node.path


def test_order_aware_nodes_compute_in_nchw_what_they_did_in_nhwc(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _image_plan(_MIXED)
    module = build_module(plan)
    # the input to NCHW; concat's output to NHWC once, for flatten alone
    assert module.layout.permutations == 2
    first = dict(
        zip((node.path for node in plan.model.graph().nodes), module.layout.channels_first, strict=True)
    )
    assert [path for path, channels_first in first.items() if not channels_first] == [
        "flatten_10",
        "flat",
        "concat_12",
        "dense_13",
    ]
    _assert_same(_train_forward(module, plan), _train_forward(_nhwc_module(plan, monkeypatch), plan))


def test_an_image_output_is_nhwc() -> None:
    plan = _image_plan((Conv2D(filters=2, kernel_size=3), ReLU()))
    module = build_module(plan)
    assert module.layout.permutations == 2
    assert tuple(module(torch.zeros(3, 8, 8, 3)).shape) == (3, 6, 6, 2)


# ReLU -> zero_pad2d -> max pool and zero_pad2d -> strided convolution (ResNet's stem and its
# downsampling), beside pads that cannot fold: before a pool on a value that may be negative,
# and read by two nodes
_PADDED = (
    ZeroPad2D(padding=1),
    Conv2D(filters=4, kernel_size=3, strides=2),
    ReLU(),
    ZeroPad2D(padding=1),
    MaxPool2D(pool_size=3, strides=2),
    Conv2D(filters=4, kernel_size=1, name="linear"),
    ZeroPad2D(padding=1, name="pad_linear"),
    MaxPool2D(pool_size=3, strides=1, name="pooled"),
    ZeroPad2D(padding=1, name="shared"),
    Conv2D(filters=4, kernel_size=3, name="left"),
    Conv2D(filters=4, kernel_size=3, inputs=("shared",)),
    Add(inputs=("left", "conv2d_10")),
    GlobalAvgPool2D(),
)


def test_a_symmetric_zero_pad_folds_into_the_node_that_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _image_plan(_PADDED)
    module = build_module(plan)
    assert folded_paddings(plan.model.graph()) == {0: (1, 1), 3: (1, 1)}
    assert module.layout.absorbed == {1: (1, 1), 4: (1, 1)}
    with monkeypatch.context() as patched:
        patched.setattr("crosstrain.backends.torch.layout.folded_paddings", lambda graph: {})
        padded = build_module(plan)
    _assert_same(_train_forward(module, plan), _train_forward(padded, plan))


# ReLU -> 2x2 max pool and ReLU6 -> 3x3 max pool at stride 1 (each pooled first), beside a
# ReLU two nodes read and a ReLU before a pool that pads (each kept in order)
_ACTIVATED_POOLS = (
    Conv2D(filters=4, kernel_size=3, padding="same"),
    ReLU(),
    MaxPool2D(pool_size=2),
    Conv2D(filters=4, kernel_size=1, name="narrow"),
    ReLU6(),
    MaxPool2D(pool_size=3, strides=1, padding="same", name="padded"),
    ReLU(name="shared"),
    MaxPool2D(pool_size=3, strides=1, name="pooled"),
    Conv2D(filters=4, kernel_size=1, inputs=("shared",), name="beside"),
    GlobalAvgPool2D(inputs=("pooled",)),
    GlobalAvgPool2D(inputs=("beside",), name="other"),
    Add(inputs=("global_avg_pool2d_9", "other")),
)


def test_an_activation_read_only_by_a_valid_max_pool_runs_after_it_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    valid = MaxPool2D(pool_size=3, strides=1, name="valid")
    plan = _image_plan((*_ACTIVATED_POOLS[:5], valid, GlobalAvgPool2D()))
    assert activations_pooled_first(plan.model.graph(), {}) == {1: 2, 4: 5}
    kept = _image_plan(_ACTIVATED_POOLS)
    assert activations_pooled_first(kept.model.graph(), {}) == {1: 2}
    for each in (plan, kept):
        module = build_module(each)
        with monkeypatch.context() as patched:
            patched.setattr(
                "crosstrain.backends.torch.layout.activations_pooled_first", lambda graph, absorbed: {}
            )
            in_order = build_module(each)
        assert len(module.layout.steps) == len(in_order.layout.steps)
        actual, expected = _train_forward(module, each), _train_forward(in_order, each)
        assert actual.keys() == expected.keys()
        for name, value in expected.items():
            assert np.array_equal(actual[name], value), name
