"""The CNN's gradient, torch against tf, where tied max-pool windows and ReLUs at exactly
zero make the two frameworks' conventions matter.

torch's MaxPool2d sends a window's gradient to the first maximum in its row-major scan
and its ReLU has zero gradient at zero. If tf routed ties differently (to another or to
every tied element) or let the gradient through a ReLU at zero, the two backends would
train the same plan to different weights; these tests pin the conventions, on the
layers the backends build from a plan, with identical weights and inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.model.layers import Flatten, MaxPool2D, ReLU
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.plan import ModelSpec, Plan
from crosstrain.core.spec.planfile import load_plan

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross

EXAMPLE_CNN = Path(__file__).parents[2] / "examples" / "digits_cnn.py"


def _torch_gradients(
    plan: Plan, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray | None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Mean cross-entropy (or the plain sum of outputs without labels) differentiated by torch:
    (d/dx in NHWC, {neutral name: d/dweight in neutral layout})."""
    from crosstrain.backends.torch.model import build_module, load_neutral, neutral_state

    module = build_module(plan)
    load_neutral(module, plan, weights)
    inputs = torch.from_numpy(x).requires_grad_()
    outputs = module(inputs)
    loss = outputs.sum() if y is None else torch.nn.functional.cross_entropy(outputs, torch.from_numpy(y))
    loss.backward()
    with torch.no_grad():  # the gradients in the weights' place: neutral_state lays them out
        for parameter in module.parameters():
            assert parameter.grad is not None
            parameter.copy_(parameter.grad)
    return inputs.grad.numpy(), neutral_state(module, plan)


def _tf_gradients(
    plan: Plan, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray | None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    from crosstrain.backends.tf.model import build_model, load_neutral

    model = build_model(plan)
    load_neutral(model, plan, weights)
    inputs = tf.constant(x)
    named = {f"{layer.name}.{v.name}": v for layer in model.layers for v in layer.trainable_weights}
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        outputs = model(inputs, training=True)
        loss = (
            tf.reduce_sum(outputs)
            if y is None
            else tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=outputs))
        )
    input_grad, *grads = tape.gradient(loss, [inputs, *named.values()])
    return input_grad.numpy(), {name: g.numpy() for name, g in zip(named, grads, strict=True)}


def _windows(images: np.ndarray) -> np.ndarray:
    """NHWC images -> their non-overlapping 2x2 windows, [..., 4]."""
    n, h, w, c = images.shape
    return (
        images.reshape(n, h // 2, 2, w // 2, 2, c)
        .transpose(0, 1, 3, 5, 2, 4)
        .reshape(n, h // 2, w // 2, c, 4)
    )


def _tied(windows: np.ndarray) -> np.ndarray:
    """Which windows hold their maximum more than once."""
    return np.asarray((windows == windows.max(axis=-1, keepdims=True)).sum(axis=-1) > 1)


def _tie_counts(windows: np.ndarray) -> tuple[int, int]:
    """(windows tied at a positive maximum, windows tied at zero), so a test is not vacuous."""
    tied, maximum = _tied(windows), windows.max(axis=-1)
    return int((tied & (maximum > 0)).sum()), int((tied & (maximum == 0)).sum())


def test_max_pool_ties_and_relu_at_zero_route_the_gradient_like_torch() -> None:
    # small integers: most 2x2 windows hold ties, some tied at a positive maximum, some at 0
    plan = Plan(
        name="ties",
        model=ModelSpec(input_shape=(8, 8, 6), layers=(ReLU(), MaxPool2D(pool_size=2), Flatten())),
    )
    x = np.random.default_rng(0).integers(-2, 3, size=(16, 8, 8, 6)).astype(np.float32)
    windows = _windows(np.maximum(x, 0))
    positive_ties, zero_ties = _tie_counts(windows)
    assert positive_ties > 100 and zero_ties > 100

    torch_grad, _ = _torch_gradients(plan, {}, x, None)
    tf_grad, _ = _tf_gradients(plan, {}, x, None)
    # every window with a positive maximum sends its gradient to exactly one element, and
    # the same element in both frameworks: the first maximum in the window's row-major scan
    routed = _windows(tf_grad).sum(axis=-1)
    assert np.array_equal(routed, (windows.max(axis=-1) > 0).astype(np.float32))
    tied_positive = _tied(windows) & (windows.max(axis=-1) > 0)
    first = _windows(torch_grad).argmax(axis=-1)
    assert np.array_equal(first[tied_positive], windows.argmax(axis=-1)[tied_positive])
    # exact on purpose: d(sum)/dx through ReLU and non-overlapping max-pool is 0 or 1, routed
    # without arithmetic, so any difference is a routing difference
    np.testing.assert_array_equal(tf_grad, torch_grad)


def test_example_cnn_gradients_agree_on_windows_full_of_ties() -> None:
    """The digits are mostly blank: every blank patch gives its conv output the bias alone,
    so pooled windows tie. Half the first conv's channels get a zero bias (ties at an exact
    ReLU zero), half a positive one (ties at a positive maximum)."""
    plan = load_plan(EXAMPLE_CNN)
    weights = dict(initial_weights(plan))
    bias = weights["conv2d_0.bias"]
    weights["conv2d_0.bias"] = np.where(np.arange(bias.size) % 2 == 0, 0.05, 0.0).astype(np.float32)
    train = load_datasets(plan).train
    x, y = train.x[:64], train.y[:64]

    torch_input, torch_grads = _torch_gradients(plan, weights, x, y)
    tf_input, tf_grads = _tf_gradients(plan, weights, x, y)

    conv = np.einsum("nhwk,kc->nhwc", _patches(x), weights["conv2d_0.kernel"].reshape(9, -1))
    windows = _windows(np.maximum(conv + weights["conv2d_0.bias"], 0))
    positive_ties, zero_ties = _tie_counts(windows)
    assert positive_ties > 300 and zero_ties > 300

    assert sorted(tf_grads) == sorted(torch_grads)
    for name, grad in torch_grads.items():
        np.testing.assert_allclose(tf_grads[name], grad, rtol=0, atol=1e-5 * np.abs(grad).max(), err_msg=name)
    np.testing.assert_allclose(tf_input, torch_input, rtol=0, atol=1e-5 * np.abs(torch_input).max())


def _patches(x: np.ndarray) -> np.ndarray:
    """3x3 'same' patches of single-channel NHWC images, [n, h, w, 9] in kernel (kh, kw) order."""
    padded = np.pad(x[..., 0], ((0, 0), (1, 1), (1, 1)))
    h, w = x.shape[1:3]
    return np.stack([padded[:, i : i + h, j : j + w] for i in range(3) for j in range(3)], axis=-1)
