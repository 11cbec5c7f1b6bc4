"""torch's batch norm node against its formula (docs/layers.md) differentiated by
autograd, in float64: the one-pass statistics and the closed-form backward
(layers._MaskedBatchNorm) give the same outputs, gradients and running statistics, for
random row masks and a micro-batch of padding only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.nodes import ForwardContext  # noqa: E402
from crosstrain.backends.torch.norms import BatchNormNode  # noqa: E402
from crosstrain.core.model.graph import Node  # noqa: E402
from crosstrain.core.model.layers import BatchNorm  # noqa: E402

pytestmark = pytest.mark.torch

ROWS = 6


def reference(node: BatchNormNode, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The formula as written before the closed form: masked sums, then squared
    deviations, differentiated by autograd; it moves the running statistics the same way."""
    weight = weight.reshape(-1, *[1] * (x.dim() - 1))
    count = weight.sum() * node.positions
    divisor = torch.clamp(count, min=1)
    mean = (x * weight).sum(node.axes) / divisor
    variance = ((x - mean.reshape(node.per_feature)) ** 2 * weight).sum(node.axes) / divisor
    with torch.no_grad():
        node._move(mean, variance, count)
    y = (x - mean.reshape(node.per_feature)) * torch.rsqrt(variance + node.epsilon).reshape(node.per_feature)
    if node.scale is not None:
        y = y * node.scale.reshape(node.per_feature)
    if node.offset is not None:
        y = y + node.offset.reshape(node.per_feature)
    return y


def make_node(shape: tuple[int, ...], channels_first: bool, layer: BatchNorm) -> BatchNormNode:
    node = Node(0, "bn", layer, (-1,), (shape,), shape, "model.layers[0]", (0,))
    module = BatchNormNode(layer, node, channels_first).double()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in (module.scale, module.offset, module.moving_mean):
            if tensor is not None:
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64))
    return module


MASKS = {
    "random": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
    "one_real_row": torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]),
    "all_real": torch.ones(ROWS),
    "all_padding": torch.zeros(ROWS),
}
#: (row shape in the neutral order, whether the node works on NCHW images)
SHAPES = {
    "nchw_image": ((4, 5, 3), True),
    "nhwc_image": ((4, 5, 3), False),
    "sequence": ((7, 3), False),
    "vector": ((3,), False),
}
LAYERS = {
    "scaled_centred": BatchNorm(momentum=0.7),
    "unscaled": BatchNorm(scale=False),
    "uncentred": BatchNorm(center=False),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", LAYERS)
def test_closed_form_equals_autograd_of_the_formula(mask: str, shape: str, layer: str) -> None:
    row_shape, channels_first = SHAPES[shape]
    fast, slow = (make_node(row_shape, channels_first, LAYERS[layer]) for _ in range(2))
    generator = torch.Generator().manual_seed(2)
    neutral = 3.0 + 2.0 * torch.randn((ROWS, *row_shape), generator=generator, dtype=torch.float64)
    x = (
        neutral.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        if channels_first
        else neutral
    )
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    weight = MASKS[mask].double()
    outputs, gradients = [], []
    for node in (fast, slow):
        leaf = x.clone().requires_grad_(True)
        y = node([leaf], ForwardContext(weight=weight)) if node is fast else reference(node, leaf, weight)
        (y * upstream).sum().backward()
        outputs.append(y.detach())
        params = [p.grad for p in (node.scale, node.offset) if p is not None]
        gradients.append([leaf.grad, *params, node.moving_mean, node.moving_variance])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)
    assert outputs[0].dtype == torch.float64
    for ours, theirs in zip(*gradients, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_bfloat16_in_bfloat16_out_with_float32_statistics() -> None:
    """Under autocast the convolutions around it run in bfloat16: it reads and writes
    bfloat16 (channels-last kept), accumulating in its float32 weights."""
    layer = BatchNorm()
    node = Node(0, "bn", layer, (-1,), ((4, 5, 3),), (4, 5, 3), "model.layers[0]", (0,))
    module = BatchNormNode(layer, node, channels_first=True)
    x = torch.randn(ROWS, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    leaf = x.to(torch.bfloat16).requires_grad_(True)
    y = module([leaf], ForwardContext(weight=MASKS["random"]))
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16
    assert module.moving_mean.dtype == torch.float32 and module.scale is not None
    assert module.scale.grad is not None and module.scale.grad.dtype == torch.float32
    expected = reference(
        BatchNormNode(layer, node, channels_first=True).double(),
        leaf.detach().double(),
        MASKS["random"].double(),
    )
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=0.05)


def test_traced_by_torch_compile_as_it_runs_eagerly() -> None:
    """``train.compile``: dynamo traces the custom autograd function into one graph (no
    break), forward and backward, with the same results as eager."""
    row_shape, channels_first = SHAPES["nchw_image"]
    weight = MASKS["random"]
    results = []
    for compiled in (False, True):
        layer = BatchNorm()
        node = Node(0, "bn", layer, (-1,), (row_shape,), row_shape, "model.layers[0]", (0,))
        module = BatchNormNode(layer, node, channels_first)
        leaf = torch.randn(ROWS, 3, 4, 5, generator=torch.Generator().manual_seed(3)).requires_grad_(True)

        def step(x: torch.Tensor, module: BatchNormNode = module) -> torch.Tensor:
            return torch.relu(module([x], ForwardContext(weight=weight)))

        run = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
        (run(leaf) ** 2).sum().backward()
        results.append([leaf.grad, module.scale.grad, module.moving_variance])  # type: ignore[union-attr]
    for eager, traced in zip(*results, strict=True):
        torch.testing.assert_close(traced, eager)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_real_on_one_process_is_the_formula(shape: str) -> None:
    """No row mask (``weight`` None: every row real, one process): torch's own batch norm
    where the features are on axis 1, the masked form with a mask of ones elsewhere — the
    formula's outputs, gradients and running statistics either way."""
    row_shape, channels_first = SHAPES[shape]
    fast, slow = (make_node(row_shape, channels_first, LAYERS["scaled_centred"]) for _ in range(2))
    generator = torch.Generator().manual_seed(4)
    x = 3.0 + 2.0 * torch.randn((ROWS, *row_shape), generator=generator, dtype=torch.float64)
    if channels_first:
        x = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    results = []
    ones = MASKS["all_real"].double()
    for node in (fast, slow):
        leaf = x.clone().requires_grad_(True)
        y = node([leaf], ForwardContext()) if node is fast else reference(node, leaf, ones)
        (y * upstream).sum().backward()
        assert node.scale is not None and node.offset is not None
        gradients = [leaf.grad, node.scale.grad, node.offset.grad]
        results.append([y, *gradients, node.moving_mean, node.moving_variance])
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
