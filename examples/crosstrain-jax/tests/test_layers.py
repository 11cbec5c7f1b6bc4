"""Layers and losses against numpy versions of docs/layers.md, in this process, with the
batch sharded over two CPU devices (conftest asks XLA for two) as the backend runs it."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import jax
import numpy as np
import pytest
from crosstrain import Attention, BatchNorm, Dense, Dropout, Layer, ModelSpec, Plan
from crosstrain import dropout as reference
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from crosstrain_jax.dense import keep_mask
from crosstrain_jax.model import LOSSES, METRIC_COUNTS, build_forward
from crosstrain_jax.nodes import TrainInputs

Arrays = dict[str, np.ndarray]


def _sharded(value: np.ndarray) -> jax.Array:
    """The batch axis split over both devices."""
    mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("data",))
    return jax.device_put(value, NamedSharding(mesh, PartitionSpec("data")))


def _plan(input_shape: tuple[int, ...], *layers: Layer, seed: int = 0) -> Plan:
    return Plan(model=ModelSpec(input_shape=input_shape, layers=layers), seed=seed)


def _train_inputs(step: int, rows: np.ndarray, weight: np.ndarray) -> TrainInputs:
    as_uint32 = (np.asarray(rows, np.int64) & reference.MASK32).astype(np.uint32)
    return TrainInputs(np.uint32(step & reference.MASK32), _sharded(as_uint32),
                       _sharded(weight.astype(np.float32)))


def _run(plan: Plan, weights: Arrays, x: np.ndarray,
         train: TrainInputs | None) -> tuple[np.ndarray, Arrays]:
    outputs, updates = jax.jit(build_forward(plan))(weights, _sharded(x), train)
    return np.asarray(outputs), {name: np.asarray(value) for name, value in updates.items()}


# --------------------------------------------------------------------------- dropout


_COUNTERS = [(0, 0, 0), (3, 17, 5), (2**32 - 1, 2**31 + 3, 1000), (-7, 123_456_789, 2)]


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_masks_equal_the_reference_bit_for_bit(rate: float) -> None:
    rows = np.array([0, 1, 7, 31, 1000, 2**31 + 5, 2**32 - 1, 2**40 + 3], np.int64)
    as_uint32 = (rows & reference.MASK32).astype(np.uint32)
    for seed, step, layer in _COUNTERS:
        # step and rows traced, as in the compiled train step
        compiled = jax.jit(lambda step, rows, seed=seed, layer=layer: keep_mask(
            seed, step, layer, rows, 300, rate))
        actual = np.asarray(compiled(np.uint32(step & reference.MASK32), as_uint32))
        expected = reference.keep_mask(seed, step, layer, rows, 300, rate)
        assert actual.dtype == expected.dtype == np.bool_
        assert np.array_equal(actual, expected), (seed, step, layer)
        assert abs(1 - actual.mean() - rate) < 0.05  # and it drops about `rate`


def test_the_dropout_layer_drops_by_global_row_step_and_node_index() -> None:
    # two dropouts: nodes 0 and 1; rows 40.. as in a later micro-batch of the step
    plan = _plan((3, 4), Dropout(rate=0.3), Dropout(rate=0.5), seed=9)
    x = np.random.default_rng(0).normal(size=(6, 3, 4)).astype(np.float32)
    rows, step = np.arange(40, 46), 11
    outputs, _ = _run(plan, {}, x, _train_inputs(step, rows, np.ones(6)))
    expected = x
    for node, rate in enumerate((0.3, 0.5)):
        keep = reference.keep_mask(9, step, node, rows, 12, rate).reshape(x.shape)
        expected = (expected * keep.astype(np.float32)) * np.float32(1 / (1 - rate))
    assert np.array_equal(outputs, expected)
    evaluated, _ = _run(plan, {}, x, None)
    assert np.array_equal(evaluated, x)  # evaluation drops nothing


# --------------------------------------------------------------------------- batch norm


def _batchnorm_weights(rng: np.random.Generator, features: int) -> Arrays:
    return {
        "bn.scale": rng.uniform(0.5, 1.5, features).astype(np.float32),
        "bn.offset": rng.normal(size=features).astype(np.float32),
        "bn.moving_mean": rng.normal(size=features).astype(np.float32),
        "bn.moving_variance": rng.uniform(0.5, 2, features).astype(np.float32),
    }


def test_batchnorm_uses_the_real_rows_of_the_global_batch_and_moves_its_statistics() -> None:
    layer = BatchNorm(momentum=0.8, epsilon=1e-3, name="bn")
    plan = _plan((3, 4), layer)  # 3 positions per row, 4 features
    rng = np.random.default_rng(1)
    weights = _batchnorm_weights(rng, 4)
    x = rng.normal(2.0, 3.0, size=(8, 3, 4)).astype(np.float32)
    weight = np.array([1, 1, 1, 0, 1, 1, 0, 0], np.float32)  # padding on both devices
    x[weight == 0] = 1e3  # padding rows must not move the statistics
    outputs, updates = _run(plan, weights, x, _train_inputs(0, np.arange(8), weight))

    real = x[weight == 1].astype(np.float64).reshape(-1, 4)  # n = 5 rows x 3 positions
    mean, variance = real.mean(axis=0), real.var(axis=0)
    expected = (x - mean) / np.sqrt(variance + 1e-3) * weights["bn.scale"] + weights["bn.offset"]
    real_rows = weight == 1
    np.testing.assert_allclose(outputs[real_rows], expected[real_rows], rtol=1e-5, atol=1e-5)
    unbiased = real.var(axis=0, ddof=1)  # var * n / (n - 1)
    np.testing.assert_allclose(updates["bn.moving_mean"],
                               0.8 * weights["bn.moving_mean"] + 0.2 * mean, rtol=1e-5)
    np.testing.assert_allclose(updates["bn.moving_variance"],
                               0.8 * weights["bn.moving_variance"] + 0.2 * unbiased, rtol=1e-5)

    evaluated, moved = _run(plan, weights, x, None)  # evaluation: the moving statistics
    assert moved == {}
    expected_eval = ((x - weights["bn.moving_mean"])
                     / np.sqrt(weights["bn.moving_variance"] + 1e-3)
                     * weights["bn.scale"] + weights["bn.offset"])
    np.testing.assert_allclose(evaluated, expected_eval, rtol=1e-5, atol=1e-5)


def test_batchnorm_on_a_padding_only_micro_batch_stays_finite_and_keeps_its_statistics() -> None:
    plan = _plan((4,), BatchNorm(name="bn"))
    weights = _batchnorm_weights(np.random.default_rng(2), 4)
    x = np.ones((4, 4), np.float32)
    outputs, updates = _run(plan, weights, x, _train_inputs(0, np.arange(4), np.zeros(4)))
    assert np.all(np.isfinite(outputs))
    for name in ("bn.moving_mean", "bn.moving_variance"):
        assert np.array_equal(updates[name], weights[name])


# --------------------------------------------------------------------------- attention


def _reference_attention(x: np.ndarray, weights: Arrays, heads: int, causal: bool) -> np.ndarray:
    """docs/layers.md's attention in float64."""
    x = x.astype(np.float64)

    def project(name: str, value: np.ndarray) -> np.ndarray:
        return value @ weights[f"att.{name}_kernel"] + weights[f"att.{name}_bias"]

    _, length, units = x.shape
    size = units // heads
    q, k, v = (project(name, x) for name in ("query", "key", "value"))
    joined = np.empty_like(x)
    for head in range(heads):
        part = slice(head * size, (head + 1) * size)
        scores = q[..., part] @ k[..., part].transpose(0, 2, 1) / np.sqrt(size)
        if causal:
            scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
        probabilities = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probabilities /= probabilities.sum(axis=-1, keepdims=True)
        joined[..., part] = probabilities @ v[..., part]
    return project("output", joined)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_follows_the_spec(causal: bool) -> None:
    layer = Attention(heads=2, causal=causal, name="att")
    plan = _plan((5, 8), layer)
    weights = plan.model.graph().init_weights(3)
    rng = np.random.default_rng(3)
    weights = {name: (value + 0.1 * rng.normal(size=value.shape)).astype(np.float32)
               for name, value in weights.items()}  # biases too, not just zeros
    x = rng.normal(size=(4, 5, 8)).astype(np.float32)
    outputs, _ = _run(plan, weights, x, None)
    expected = _reference_attention(x, weights, heads=2, causal=causal)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- losses


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _loss(name: str, outputs: np.ndarray, targets: np.ndarray, smoothing: float = 0.0
          ) -> np.ndarray:
    function = LOSSES[name].row_loss
    return np.asarray(jax.jit(function, static_argnums=2)(outputs, targets, smoothing))


def _hits(metric: str, logits: np.ndarray, targets: np.ndarray, top_k: int = 5) -> np.ndarray:
    _, function = METRIC_COUNTS[metric]
    plan = attrs.evolve(_plan((6,), Dense(units=6)), top_k=top_k)
    return np.asarray(jax.jit(lambda o, t: function(o, t, plan))(logits, targets))


def test_cross_entropy_sums_over_a_rows_target_positions() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 4, 6)).astype(np.float32)
    targets = rng.integers(0, 6, size=(3, 4)).astype(np.int32)
    log_probs = _log_softmax(logits.astype(np.float64))
    picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(_loss("cross_entropy", logits, targets), -picked.sum(axis=1),
                               rtol=1e-6)
    # label smoothing 0.2: 0.8 on the label's log-probability, 0.2 on the classes' mean
    smoothed = -(0.8 * picked + 0.2 * log_probs.mean(axis=-1)).sum(axis=1)
    np.testing.assert_allclose(_loss("cross_entropy", logits, targets, 0.2), smoothed, rtol=1e-6)
    hits = (logits.argmax(axis=-1) == targets).sum(axis=1)
    assert np.array_equal(_hits("accuracy", logits, targets), hits)
    # top 2: fewer than two logits above the target's
    above = (logits > np.take_along_axis(logits, targets[..., None], -1)).sum(axis=-1)
    assert np.array_equal(_hits("top_k_accuracy", logits, targets, 2), (above < 2).sum(axis=1))
    assert LOSSES["cross_entropy"].targets_per_row(targets.shape) == 4


def test_binary_cross_entropy_is_the_mean_of_each_outputs_sigmoid_loss() -> None:
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(4, 3)) * 5).astype(np.float32)
    targets = rng.integers(0, 2, size=(4, 3)).astype(np.float32)
    probability = 1 / (1 + np.exp(-logits.astype(np.float64)))
    each = -(targets * np.log(probability) + (1 - targets) * np.log1p(-probability))
    np.testing.assert_allclose(_loss("binary_cross_entropy", logits, targets), each.mean(axis=1),
                               rtol=1e-5)
    assert LOSSES["binary_cross_entropy"].targets_per_row((4, 3)) == 1


@pytest.mark.parametrize("shape", [(5, 3), (5, 2, 3)])
def test_mse_is_the_mean_over_a_rows_outputs(shape: Sequence[int]) -> None:
    rng = np.random.default_rng(5)
    outputs, targets = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    expected = np.square(outputs - targets).reshape(shape[0], -1).mean(axis=1)
    np.testing.assert_allclose(_loss("mse", outputs, targets), expected, rtol=1e-6)
    assert LOSSES["mse"].targets_per_row(tuple(shape)) == 1
