"""The Keras model built from neutral layers, and the optimizer written in TensorFlow ops:
layouts, names and update rules, checked against numpy references in this process."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.run.job import World
from crosstrain.core.spec.plan import OptimizerSpec, Plan
from crosstrain.core.spec.planfile import load_plan

pytest.importorskip("tensorflow")

from crosstrain.backends.tf.model import build_model, load_neutral, neutral_state
from crosstrain.backends.tf.optimizer import (
    OPTIMIZERS,
    DynamicLossScale,
    clip_like_torch,
    make_slots,
    slot_count,
    step_scalars,
    update_rule,
)
from crosstrain.backends.tf.strategy import TfStrategy
from crosstrain.core.spec.plan_dicts import structure_plan

pytestmark = pytest.mark.tf


def _plan(input_shape: list[int], layers: list[dict[str, object]]) -> Plan:
    return structure_plan({"model": {"input_shape": input_shape, "layers": layers}})


CNN = _plan(
    [6, 6, 2],
    [
        {"type": "conv2d", "filters": 3, "kernel_size": 3, "padding": "same"},
        {"type": "layernorm", "eps": 1e-3},
        {"type": "maxpool2d", "pool_size": 2},
        {"type": "conv2d", "filters": 4, "kernel_size": 2, "strides": 1},
        {"type": "flatten"},
        {"type": "dense", "units": 5, "name": "head"},
    ],
)


def _random_weights(plan: Plan, seed: int = 0) -> dict[str, np.ndarray]:
    """crosstrain's initial weights with every array (scales and offsets too) made random."""
    rng = np.random.default_rng(seed)
    weights = plan.model.graph().init_weights(plan.seed)
    return {name: rng.normal(size=value.shape).astype(np.float32) for name, value in weights.items()}


def test_keras_layers_keep_the_neutral_names_and_shapes() -> None:
    model = build_model(CNN)
    expected = [node.output_shape for node in CNN.model.graph().nodes]
    value, shapes = np.zeros((2, *CNN.model.input_shape), np.float32), []
    for layer in model.layers:  # the CNN is a chain: each layer feeds the next
        value = layer(value)
        shapes.append(tuple(value.shape[1:]))
    assert shapes == expected
    assert [layer.name for layer in model.layers] == [
        "conv2d_0",
        "layernorm_1",
        "maxpool2d_2",
        "conv2d_3",
        "flatten_4",
        "head",
    ]


def test_weights_round_trip_exactly_and_layernorm_maps_scale_to_gamma() -> None:
    model = build_model(CNN)
    weights = _random_weights(CNN)
    load_neutral(model, CNN, weights)
    state = neutral_state(model, CNN)
    assert sorted(state) == sorted(weights)
    for name, value in weights.items():
        assert np.array_equal(state[name], value), name
    norm = model.get_layer("layernorm_1")
    assert np.array_equal(norm.gamma.numpy(), weights["layernorm_1.scale"])
    assert np.array_equal(norm.beta.numpy(), weights["layernorm_1.offset"])


def test_loading_a_misfit_weight_names_it() -> None:
    model = build_model(CNN)
    with pytest.raises(ValueError, match=r"head\.kernel"):
        load_neutral(model, CNN, {"head.kernel": np.zeros((3, 5), np.float32)})
    with pytest.raises(KeyError, match=r"nosuch\.bias"):
        load_neutral(model, CNN, {"nosuch.bias": np.zeros(5, np.float32)})


def _numpy_forward(x: np.ndarray, weights: dict[str, np.ndarray], eps: float) -> np.ndarray:
    """dense -> layernorm -> exact (erf) gelu -> dense, written out in numpy."""
    hidden = x @ weights["dense_0.kernel"] + weights["dense_0.bias"]
    mean = hidden.mean(axis=1, keepdims=True)
    variance = hidden.var(axis=1, keepdims=True)
    normed = (hidden - mean) / np.sqrt(variance + eps)
    normed = normed * weights["layernorm_1.scale"] + weights["layernorm_1.offset"]
    erf = np.vectorize(math.erf)
    activated = 0.5 * normed * (1.0 + erf(normed / math.sqrt(2.0)))
    return activated @ weights["dense_3.kernel"] + weights["dense_3.bias"]


def test_forward_matches_numpy_with_exact_gelu_and_the_plan_eps() -> None:
    plan = _plan(
        [7],
        [
            {"type": "dense", "units": 6},
            {"type": "layernorm", "eps": 0.5},
            {"type": "gelu"},
            {"type": "dense", "units": 3},
        ],
    )
    weights = _random_weights(plan, seed=1)
    model = build_model(plan)
    load_neutral(model, plan, weights)
    x = np.random.default_rng(2).normal(size=(5, 7)).astype(np.float32)
    as_float64 = {name: value.astype(np.float64) for name, value in weights.items()}
    expected = _numpy_forward(x.astype(np.float64), as_float64, 0.5)
    # the tanh approximation of GELU, or eps 1e-3, would be off by ~1e-3
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_flatten_runs_in_channels_last_order() -> None:
    plan = _plan([2, 3, 4], [{"type": "flatten"}, {"type": "dense", "units": 24, "use_bias": False}])
    model = build_model(plan)
    load_neutral(model, plan, {"dense_1.kernel": np.eye(24, dtype=np.float32)})
    x = np.arange(2 * 24, dtype=np.float32).reshape(2, 2, 3, 4)
    assert np.array_equal(model(x).numpy(), x.reshape(2, 24))


# --------------------------------------------------------------------------- optimizer


def _run_rule(
    spec: OptimizerSpec, grads: list[np.ndarray], lrs: list[float], start: np.ndarray
) -> np.ndarray:
    """Apply the tf update rule eagerly for each (grad, lr), as the compiled step does."""
    import tensorflow as tf

    rule = update_rule(spec)
    variable = tf.Variable(start)
    slots = [tf.Variable(np.zeros_like(start)) for _ in range(1 if spec.name == "sgd" else 2)]
    for step, (grad, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        scalars = tf.constant(step_scalars(spec, lr, step, 1.0, 1))
        value, new_slots = rule(variable, tf.constant(grad), slots, scalars)
        for slot, new in zip(slots, new_slots, strict=True):
            slot.assign(new)
        variable.assign(value)
    return np.asarray(variable.numpy())


GRADS = [np.float32([0.5, -1.0, 2.0]), np.float32([0.25, 1.0, -1.0]), np.float32([1.0, 0.5, 0.0])]
LRS = [0.1, 0.2, 0.05]  # a changing lr tells "lr outside the buffer" from Keras's "lr inside"
START = np.float32([1.0, -2.0, 0.5])


def test_sgd_momentum_keeps_the_learning_rate_outside_the_buffer() -> None:
    spec = OptimizerSpec(name="sgd", momentum=0.9, weight_decay=0.01)
    weights, buffer = START.astype(np.float64), np.zeros(3)
    for grad, lr in zip(GRADS, LRS, strict=True):
        grad = grad + 0.01 * weights  # L2 on the gradient
        buffer = 0.9 * buffer + grad
        weights = weights - lr * buffer
    np.testing.assert_allclose(_run_rule(spec, GRADS, LRS, START), weights, rtol=1e-6)


def test_nesterov_looks_ahead_along_the_buffer() -> None:
    spec = OptimizerSpec(name="sgd", momentum=0.8, nesterov=True)
    weights, buffer = START.astype(np.float64), np.zeros(3)
    for grad, lr in zip(GRADS, LRS, strict=True):
        buffer = 0.8 * buffer + grad
        weights = weights - lr * (grad + 0.8 * buffer)
    np.testing.assert_allclose(_run_rule(spec, GRADS, LRS, START), weights, rtol=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_adds_eps_after_the_bias_correction_like_torch(name: str) -> None:
    # a large eps makes Keras's placement (eps beside the uncorrected sqrt(v)) visibly different
    spec = OptimizerSpec(name=name, eps=0.1, weight_decay=0.05, beta1=0.8, beta2=0.9)
    weights, mean, square = START.astype(np.float64), np.zeros(3), np.zeros(3)
    for step, (grad, lr) in enumerate(zip(GRADS, LRS, strict=True), start=1):
        grad = grad.astype(np.float64)
        if name == "adamw":
            weights = weights * (1 - lr * 0.05)
        else:
            grad = grad + 0.05 * weights
        mean = 0.8 * mean + 0.2 * grad
        square = 0.9 * square + 0.1 * grad * grad
        denominator = np.sqrt(square) / math.sqrt(1 - 0.9**step) + 0.1
        weights = weights - lr / (1 - 0.8**step) * mean / denominator
    np.testing.assert_allclose(_run_rule(spec, GRADS, LRS, START), weights, rtol=1e-6)


def test_the_optimizer_table_covers_core_s_names_and_slots_only_what_it_trains() -> None:
    import tensorflow as tf

    from crosstrain.core.model.optimizers import OPTIMIZER_SLOTS
    from crosstrain.core.model.optimizers import OPTIMIZERS as CORE_OPTIMIZERS

    assert set(OPTIMIZERS) == set(CORE_OPTIMIZERS)
    for name, slots in OPTIMIZER_SLOTS.items():  # a checkpoint names each slot the row keeps
        assert slot_count(OptimizerSpec(name=name, momentum=0.5)) == len(slots), name
    counts = [slot_count(OptimizerSpec(name="sgd")), slot_count(OptimizerSpec(name="sgd", momentum=0.5))]
    assert counts + [slot_count(OptimizerSpec(name=name)) for name in ("adam", "adamw")] == [0, 1, 2, 2]
    moving = tf.Variable(np.ones(3, np.float32), trainable=False, name="moving_mean")
    with pytest.raises(ValueError, match="moving_mean"):
        make_slots(OptimizerSpec(name="adam"), [moving])


def test_clipping_follows_torch_clip_grad_norm() -> None:
    import tensorflow as tf

    grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]])]  # global norm 5
    clipped = [g.numpy() for g in clip_like_torch(grads, 1.0)]
    np.testing.assert_allclose(clipped[0], [3.0 / (5 + 1e-6), 0.0], rtol=1e-6)
    untouched = [g.numpy() for g in clip_like_torch(grads, 10.0)]
    assert np.array_equal(untouched[0], [3.0, 0.0]) and np.array_equal(untouched[1], [[4.0]])


def test_loss_scale_halves_on_overflow_and_grows_after_a_run_of_finite_steps() -> None:
    scale = DynamicLossScale(scale=1024.0, growth_interval=3)
    scale.update(finite=False)
    assert scale.scale == 512.0
    for _ in range(3):
        scale.update(finite=True)
    assert scale.scale == 1024.0 and scale.finite_steps == 0


def test_fp16_skips_a_step_whose_gradients_overflow() -> None:
    """An inf gradient leaves weights and Adam's step count alone and halves the scale."""
    from crosstrain.core.data.batches import Batch, StepBatch

    plan = structure_plan(
        {
            "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 2}]},
            "loss": {"name": "mse"},
            "metrics": ["loss"],
            "optimizer": {"name": "adam"},
            "train": {"precision": "fp16"},
        }
    )
    strategy = TfStrategy(World())
    state = strategy.build(plan, plan.model.graph().init_weights(0))
    before = strategy.state_dict(state)
    huge = Batch(np.full((2, 4), 3e38, np.float32), np.zeros((2, 2), np.float32), np.ones(2, np.float32))
    strategy.train_step(state, StepBatch((huge,), 2), lr=0.1)
    assert state.loss_scale is not None and state.loss_scale.scale == 2.0**15
    assert state.optimizer_steps == 0
    for name, value in strategy.state_dict(state).items():
        assert np.array_equal(value, before[name]), name
    fine = Batch(np.ones((2, 4), np.float32), np.zeros((2, 2), np.float32), np.ones(2, np.float32))
    strategy.train_step(state, StepBatch((fine,), 2), lr=0.1)
    assert state.optimizer_steps == 1
    assert not np.array_equal(strategy.state_dict(state)["dense_0.kernel"], before["dense_0.kernel"])


def test_compiling_batch_norm_is_refused_before_launch(tmp_path: Path) -> None:
    from crosstrain.backends.tf.strategy import check_compilable
    from crosstrain.core.errors import PlanError
    from crosstrain.testing.plans import RESNET_PLAN

    (tmp_path / "plan.toml").write_text(RESNET_PLAN)
    plan = load_plan(tmp_path / "plan.toml", ["train.compile=true"])
    with pytest.raises(PlanError, match=r"cannot compile batch norm \(model.layers\[1\]\)") as error:
        check_compilable(plan)
    assert error.value.field == "train.compile"
    check_compilable(load_plan(tmp_path / "plan.toml"))  # eager: nothing to refuse
