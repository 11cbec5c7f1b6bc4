"""The strategy driven directly, in this process, on one and two CPU devices (conftest
asks XLA for two): evaluation equal at both worlds, neutral weights in and out, torch's
optimizer formulas."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from crosstrain import (
    Batch,
    BatchNorm,
    Dense,
    ModelSpec,
    OptimizerSpec,
    Plan,
    StepBatch,
    TrainSpec,
    World,
)
from crosstrain.api import prepare_plan
from crosstrain.core.run.evaluation import evaluate

# the loop's own pieces, driven by hand here: internals, not the public surface
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.loop import initial_weights
from crosstrain.testing import assert_same_eval

from crosstrain_jax import JaxState, JaxStrategy
from crosstrain_jax.optimizer import (
    OptimizerState,
    Tree,
    apply_update,
    as_dtype,
    clip_by_global_norm,
    host_scalars,
    init_state,
)
from jaxtest_support import CNN_PLAN


def _strategy(devices: int) -> JaxStrategy:
    return JaxStrategy(World(local_replicas=devices), devices=jax.devices("cpu")[:devices])


def _moved_weights(plan: Plan) -> dict[str, np.ndarray]:
    """Initial weights moved off their init values, as after some training (variances stay
    positive)."""
    rng = np.random.default_rng(11)
    moved = {name: (value + 0.1 * rng.normal(size=value.shape)).astype(np.float32)
             for name, value in initial_weights(plan).items()}
    return {name: np.abs(value) if name.endswith(".moving_variance") else value
            for name, value in moved.items()}


def _evaluate_at(devices: int, plan: Plan, weights: dict[str, np.ndarray]) -> dict[str, float]:
    strategy = _strategy(devices)
    state = strategy.build(plan, initial_weights(plan))
    strategy.load_state_dict(state, weights)
    evaluation = load_datasets(plan).eval
    assert evaluation is not None
    return evaluate(strategy, state, evaluation, plan)


def test_two_devices_are_available_to_these_tests() -> None:
    assert len(jax.devices("cpu")) == 2


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_eval_at_world_2_equals_world_1(
    write_plan: Callable[..., Path], tmp_path: Path, odd_npz: Path, loss: str
) -> None:
    data = odd_npz
    if loss == "mse":  # regression targets with the model's 10 outputs
        with np.load(odd_npz) as arrays:
            data = tmp_path / "regression.npz"
            np.savez(data, x=arrays["x"], y=arrays["x"][:, :10] * 0.5)
    metrics = "['loss']" if loss == "mse" else "['loss', 'accuracy']"
    plan = prepare_plan(write_plan(), ["data.source='npz'", f"data.path='{data}'",
                                       "train.global_batch_size=16", f"loss.name='{loss}'",
                                       f"metrics={metrics}"])
    weights = _moved_weights(plan)
    one, two = _evaluate_at(1, plan, weights), _evaluate_at(2, plan, weights)
    assert one["count"] == 41  # 203 rows x 0.2: not a multiple of the batch of 16
    # counts and hits exactly; the loss within fp32 rounding of rows in batches of 8 vs 16
    assert_same_eval(two, one)
    assert one["loss"] > 0


@pytest.mark.parametrize("model", ["cnn", "tokens"])
def test_eval_of_every_layer_type_at_world_2_equals_world_1(
    write_plan: Callable[..., Path], token_plan: Path, model: str
) -> None:
    # batch norm evaluates with its moving statistics; token counts are target positions
    plan = prepare_plan(write_plan(CNN_PLAN) if model == "cnn" else token_plan)
    weights = _moved_weights(plan)
    one, two = _evaluate_at(1, plan, weights), _evaluate_at(2, plan, weights)
    assert one["count"] == (60 if model == "cnn" else 80 * 16)
    assert_same_eval(two, one)


def test_moving_statistics_follow_each_micro_batch_and_no_optimizer_touches_them() -> None:
    plan = Plan(
        model=ModelSpec(input_shape=(3,), layers=(BatchNorm(momentum=0.5, name="bn"),
                                                  Dense(units=4))),
        optimizer=OptimizerSpec(name="sgd", lr=0.5, momentum=0.9, weight_decay=0.5),
        train=TrainSpec(global_batch_size=8, grad_accum_steps=2, clip_grad_norm=0.1),
        metrics=("loss",),
    )
    strategy = _strategy(2)
    state: JaxState = strategy.build(plan, initial_weights(plan))
    assert state.trainable == ("bn.scale", "bn.offset", "dense_1.kernel", "dense_1.bias")
    assert all(set(tree) == set(state.trainable) for tree in state.optimizer_state.values())

    rng = np.random.default_rng(5)
    x = rng.normal(1.0, 2.0, size=(8, 3)).astype(np.float32)
    weight = np.array([1, 1, 1, 1, 1, 0, 1, 0], np.float32)
    micro = tuple(Batch(x[half], np.zeros(4, np.int64), weight[half], np.arange(8)[half])
                  for half in (slice(0, 4), slice(4, 8)))
    strategy.train_step(state, StepBatch(micro, global_real_rows=6), lr=0.5)

    mean, variance = np.zeros(3), np.ones(3)
    for batch in micro:  # momentum * moving + (1 - momentum) * batch, one micro-batch at a time
        real = batch.x[batch.weight == 1].astype(np.float64)
        mean = 0.5 * mean + 0.5 * real.mean(axis=0)
        variance = 0.5 * variance + 0.5 * real.var(axis=0, ddof=1)
    weights = strategy.state_dict(state)
    np.testing.assert_allclose(weights["bn.moving_mean"], mean, rtol=1e-6)
    np.testing.assert_allclose(weights["bn.moving_variance"], variance, rtol=1e-6)
    assert list(weights) == list(initial_weights(plan))  # every weight, in model order


def test_state_dict_round_trips_neutral_names_and_layouts(write_plan: Callable[..., Path]) -> None:
    plan = prepare_plan(write_plan())
    weights = _moved_weights(plan)
    strategy = _strategy(2)
    state: JaxState = strategy.build(plan, initial_weights(plan))
    strategy.load_state_dict(state, weights)
    out = strategy.state_dict(state)
    assert list(out) == ["dense_0.kernel", "dense_0.bias", "dense_2.kernel", "dense_2.bias"]
    assert out["dense_0.kernel"].shape == (64, 32)  # [in, out], as neutral
    for name, value in weights.items():
        assert np.array_equal(out[name], value), name


# --------------------------------------------------------------------------- optimizers


_OPTIMIZERS = {
    "sgd": OptimizerSpec(name="sgd", lr=0.1),
    "sgd_momentum": OptimizerSpec(name="sgd", lr=0.1, momentum=0.9),
    "sgd_nesterov_l2": OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True,
                                     weight_decay=0.01),
    "adam_l2": OptimizerSpec(name="adam", lr=0.01, weight_decay=0.01),
    "adamw": OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.1, beta1=0.3),
}


@pytest.mark.torch
@pytest.mark.parametrize("key", sorted(_OPTIMIZERS))
def test_optimizers_follow_torch_formulas(key: str) -> None:
    """Six steps with clipping and a changing lr, against torch's own optimizer.

    Not bitwise: XLA fuses a*b+c into one FMA where torch rounds between its ops, a few
    ulps apart; a wrong formula (bias correction, decoupled decay) is ~1e-3 apart."""
    torch = pytest.importorskip("torch")

    spec, rng, max_norm = _OPTIMIZERS[key], np.random.default_rng(0), 3.0
    shapes = {"dense_0.kernel": (17, 9), "dense_0.bias": (9,)}
    params = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    torch_params = [torch.nn.Parameter(torch.from_numpy(value.copy())) for value in params.values()]
    optimizer = _torch_optimizer(torch, spec, torch_params)

    def update(
        params: Tree, grads: Tree, state: OptimizerState, scalars: Mapping[str, jax.Array]
    ) -> tuple[Tree, OptimizerState]:
        clipped = clip_by_global_norm(grads, list(shapes), max_norm)
        return apply_update(spec, params, clipped, state, scalars)

    jitted = jax.jit(update)
    jax_params = {name: jax.numpy.asarray(value) for name, value in params.items()}
    state = init_state(spec, jax_params)
    for step in range(1, 7):
        lr = spec.lr * (1 - step / 10)
        grads = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
        for parameter, grad in zip(torch_params, grads.values(), strict=True):
            parameter.grad = torch.from_numpy(grad.copy())
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(torch_params, max_norm)
        optimizer.step()
        scalars = as_dtype(host_scalars(spec, lr, step), "float32")
        jax_params, state = jitted(jax_params, grads, state, scalars)
    for name, parameter in zip(shapes, torch_params, strict=True):
        np.testing.assert_allclose(np.asarray(jax_params[name]), parameter.detach().numpy(),
                                   rtol=2e-6, atol=1e-7, err_msg=name)


def _torch_optimizer(torch: Any, spec: OptimizerSpec, params: list[Any]) -> Any:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    kind = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return kind(params, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps,
                weight_decay=spec.weight_decay)
