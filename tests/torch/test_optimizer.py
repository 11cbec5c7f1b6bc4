"""The torch backend's optimizers where a step is replayed as a CUDA graph: their learning
rate lives in a device tensor the host writes, and they update as the launched ones do."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.optimizer import OPTIMIZERS, make_optimizer  # noqa: E402
from crosstrain.core.model.optimizers import OPTIMIZER_SLOTS  # noqa: E402
from crosstrain.core.spec.plan import OptimizerSpec  # noqa: E402

pytestmark = pytest.mark.torch


def test_every_row_keeps_core_s_slots_under_core_s_names() -> None:
    assert sorted(OPTIMIZERS) == sorted(OPTIMIZER_SLOTS)
    for name, row in OPTIMIZERS.items():
        assert tuple(row.slots.values()) == OPTIMIZER_SLOTS[name], name  # type: ignore[index]
        optimizer = make_optimizer(torch.nn.Linear(2, 2), OptimizerSpec(name=name))  # type: ignore[arg-type]
        assert type(optimizer) is row.kind


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec(name="sgd", lr=0.1),
        OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        OptimizerSpec(name="adam", lr=0.01, weight_decay=0.01),
        OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.1),
    ],
    ids=["sgd", "sgd-nesterov-decay", "adam", "adamw"],
)
def test_a_capturable_optimizer_reads_the_rate_the_host_writes(spec: OptimizerSpec) -> None:
    """Five steps at five learning rates, written into the optimizer's device tensor as the
    schedule moves, against the launched optimizer given each rate as a number: the same
    weights within a rounding (SGD's fused kernel, Adam's capturable one), and the state
    checkpoints read under the same names."""
    rng = np.random.default_rng(0)
    start = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    captured_module, launched_module = _module(start), _module(start)
    captured = make_optimizer(captured_module, spec, fused=True, capturable=True)
    launched = make_optimizer(launched_module, spec)
    lr = captured.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device == next(captured_module.parameters()).device
    for lr_value in (0.1, 0.05, 0.2, 0.01, 0.1):
        gradients = [rng.normal(size=value.shape).astype(np.float32) for value in start]
        for module in (captured_module, launched_module):
            for param, gradient in zip(module.parameters(), gradients, strict=True):
                param.grad = torch.from_numpy(gradient.copy())
        lr.fill_(lr_value)
        launched.param_groups[0]["lr"] = lr_value
        captured.step()
        launched.step()
        for mine, theirs in zip(captured_module.parameters(), launched_module.parameters(), strict=True):
            np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(), rtol=2e-6, atol=1e-7)
    for mine, theirs in zip(captured_module.parameters(), launched_module.parameters(), strict=True):
        assert captured.state[mine].keys() == launched.state[theirs].keys()


def _module(values: list[np.ndarray]) -> torch.nn.Module:
    module = torch.nn.Module()
    for index, value in enumerate(values):
        module.register_parameter(f"p{index}", torch.nn.Parameter(torch.from_numpy(value.copy())))
    return module


def test_sgd_under_fp16_after_a_skipped_first_step_updates_as_torchs_for_loop_sgd() -> None:
    """torch's fused SGD (the backend's under train.compile on a GPU) makes its momentum
    buffers empty at its first step and fills them in its kernel: when fp16's scaler skips
    that step (an overflow), they keep whatever memory held, and the next updates add it
    (here, three runs of the fused kernel were off by 6e19, 3e-3 and 2e26). Asked for a fused
    SGD that fp16's scaler steps, the backend builds torch's other kernels."""
    spec = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    start = [rng.normal(size=(4, 4)).astype(np.float32)]
    steps = [np.full((4, 4), np.inf, np.float32)]
    steps += [rng.normal(size=(4, 4)).astype(np.float32) * 512 for _ in range(3)]
    weights = []
    for fused in (True, False):
        module = _module(start)
        optimizer = make_optimizer(module, spec, fused=fused, loss_scaled=True)
        assert not optimizer.defaults["fused"]
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for gradient in steps:
            scaler.scale(torch.ones(()))
            param = next(module.parameters())
            param.grad = torch.from_numpy(gradient.copy())
            # memory written and freed just before the step, for an empty_like to take back
            torch.full_like(param, np.nan)
            scaler.step(optimizer)
            scaler.update()
        weights.append(next(module.parameters()).detach().numpy())
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-6, atol=1e-6)
