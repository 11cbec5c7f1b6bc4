"""The torch backend's own optimizer: SGD whose learning rate lives on the device (what a
step replayed as a CUDA graph needs) updates as torch's SGD does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.optimizer import CapturableSGD, make_optimizer  # noqa: E402
from crosstrain.core.plan import OptimizerSpec  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec(name="sgd", lr=0.1),
        OptimizerSpec(name="sgd", lr=0.1, momentum=0.9),
        OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ],
    ids=["plain", "momentum", "nesterov-decay"],
)
def test_sgd_with_its_rate_on_the_device_updates_as_torchs(spec: OptimizerSpec) -> None:
    """Five steps at five learning rates, written into the device tensor as the schedule
    moves, against torch.optim.SGD given each rate: within a rounding of the same weights
    (torch adds ``-lr * update`` in one op, this multiplies and then subtracts), and the
    momentum buffers under torch's own name."""
    rng = np.random.default_rng(0)
    start = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    ours = [torch.nn.Parameter(torch.from_numpy(value.copy())) for value in start]
    theirs = [torch.nn.Parameter(torch.from_numpy(value.copy())) for value in start]
    captured = make_optimizer_over(ours, spec, capturable=True)
    reference = make_optimizer_over(theirs, spec, capturable=False)
    assert isinstance(captured, CapturableSGD) and isinstance(reference, torch.optim.SGD)
    lr = captured.param_groups[0]["lr"]
    for lr_value in (0.1, 0.05, 0.2, 0.01, 0.1):
        gradients = [rng.normal(size=value.shape).astype(np.float32) for value in start]
        for params in (ours, theirs):
            for param, gradient in zip(params, gradients, strict=True):
                param.grad = torch.from_numpy(gradient.copy())
        lr.fill_(lr_value)
        reference.param_groups[0]["lr"] = lr_value
        captured.step()
        reference.step()
        for mine, torchs in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(mine.detach().numpy(), torchs.detach().numpy(), rtol=1e-6, atol=1e-7)
    for mine, torchs in zip(ours, theirs, strict=True):
        assert ("momentum_buffer" in captured.state[mine]) == (spec.momentum > 0)
        if spec.momentum > 0:
            buffers = captured.state[mine]["momentum_buffer"], reference.state[torchs]["momentum_buffer"]
            np.testing.assert_allclose(buffers[0].numpy(), buffers[1].numpy(), rtol=1e-6, atol=1e-7)


def make_optimizer_over(
    params: list[torch.nn.Parameter], spec: OptimizerSpec, capturable: bool
) -> torch.optim.Optimizer:
    module = torch.nn.Module()
    for index, param in enumerate(params):
        module.register_parameter(f"p{index}", param)
    return make_optimizer(module, spec, capturable=capturable)
