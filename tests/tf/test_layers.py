"""Every core layer as the tf backend builds it, against numpy written from docs/layers.md,
and the declared tables against core's vocabulary. In this process, at world 1 (TensorFlow's
default strategy, where batch norm's cross-replica sums are the identity)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest

from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.model import dropout as neutral_dropout
from crosstrain.core.model.layers import LAYER_TYPES, Block
from crosstrain.core.run.job import World
from crosstrain.core.spec.plan import LossSpec, Plan
from crosstrain.core.spec.plan_dicts import structure_plan
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, missing_names
from crosstrain.testing.layer_cases import case_plan

pytest.importorskip("tensorflow")

import tensorflow as tf

from crosstrain.backends.tf.dense import keep_mask
from crosstrain.backends.tf.layers import LAYERS
from crosstrain.backends.tf.model import (
    build_model,
    correct_per_row,
    load_neutral,
    neutral_state,
    per_row_loss,
    top_k_per_row,
)
from crosstrain.backends.tf.strategy import TfStrategy, table_vocabulary

pytestmark = pytest.mark.tf

RNG = np.random.default_rng(11)


def _plan(
    input_shape: list[int],
    layers: list[dict[str, Any]],
    input_dtype: str = "float32",
    blocks: dict[str, Any] | None = None,
    **sections: Any,
) -> Plan:
    model = {"input_shape": input_shape, "input_dtype": input_dtype, "layers": layers, "blocks": blocks or {}}
    return structure_plan({"model": model, "metrics": ["loss"], **sections})


def _random_weights(plan: Plan) -> dict[str, np.ndarray]:
    """Every weight random (variances positive), so no layer passes by an identity start."""
    weights = plan.model.graph().init_weights(plan.seed)
    random = {name: RNG.normal(size=value.shape).astype(np.float32) for name, value in weights.items()}
    for name in random:
        if name.endswith("moving_variance"):
            random[name] = np.abs(random[name]) + 0.5
    return random


def _model(plan: Plan, weights: dict[str, np.ndarray] | None = None) -> Any:
    model = build_model(plan)
    load_neutral(model, plan, weights if weights is not None else _random_weights(plan))
    return model


def _close(actual: Any, expected: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the tables


def test_the_tables_cover_core_s_vocabulary() -> None:
    assert missing_names(table_vocabulary()) == {}
    assert table_vocabulary() == TfStrategy.vocabulary()
    # every name core defines; shard "optimizer" too, and why not "full"
    vocabulary = TfStrategy.vocabulary()
    assert attrs.evolve(vocabulary, shard=frozenset({"none"}), unsharded=()) == CORE_VOCABULARY
    assert vocabulary.shard == {"none", "optimizer"} and {mode for mode, _ in vocabulary.unsharded} == {
        "full"
    }
    assert set(LAYERS) == set(LAYER_TYPES) - {Block.type}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_every_row_names_every_weight_and_exports_stock_keras(kind: str) -> None:
    """Each weight of the type's shared case sits in its row's Keras layer, and in the
    stock layer ``--format keras`` writes (which must load without crosstrain)."""
    plan = case_plan(kind)
    (node,) = (node for node in plan.model.graph().nodes if node.layer.type == kind)
    row = LAYERS[kind]
    assert set(node.weight_specs()) <= set(row.weights)
    stock = row.stock()
    if stock is not None:
        assert type(stock.build(node.layer, node)).__module__.startswith("keras.")
        assert set(node.weight_specs()) <= set(stock.weights)


EVERY_LAYER = _plan(
    [6, 6, 2],
    [
        {"type": "conv2d", "filters": 3, "kernel_size": [3, 2], "strides": [1, 2]},
        {"type": "batchnorm", "name": "bn"},
        {"type": "avgpool2d", "pool_size": 2, "strides": 1},
        {"type": "maxpool2d", "pool_size": 2, "strides": 1, "name": "max"},
        {"type": "global_avg_pool2d", "inputs": ["bn"], "name": "gap"},
        {"type": "flatten", "inputs": ["max"], "name": "flat"},
        {"type": "dense", "units": 3, "name": "proj"},
        {"type": "add", "inputs": ["gap", "proj"], "name": "sum"},
        {"type": "concat", "inputs": ["sum", "gap"], "name": "joined"},
        {"type": "block", "block": "unit", "repeat": 2},
        {"type": "dense", "units": 4, "name": "head"},
    ],
    blocks={
        "unit": {
            "layers": [
                {"type": "layernorm"},
                {"type": "gelu"},
                {"type": "tanh"},
                {"type": "relu"},
                {"type": "dropout", "rate": 0.5},
            ]
        }
    },
)


def test_every_weight_maps_to_a_keras_variable_of_its_shape_and_round_trips() -> None:
    weights = _random_weights(EVERY_LAYER)
    model = _model(EVERY_LAYER, weights)
    state = neutral_state(model, EVERY_LAYER)
    assert list(state) == list(weights)  # graph order
    for name, value in weights.items():
        assert np.array_equal(state[name], value), name
    specs = EVERY_LAYER.model.graph().weight_specs()
    trainable = {v.path for v in model.trainable_variables}
    variables = model.neutral_variables()
    for name, spec in specs.items():
        assert (variables[name].path in trainable) == spec.trainable, name
    assert len(model.trainable_variables) == sum(spec.trainable for spec in specs.values())
    assert [layer.name for layer in model.layers][:2] == ["conv2d_0", "bn"]
    assert model.get_layer("block_9.1.layernorm_0") is not None  # a block's node keeps its path


def test_every_layer_runs_in_training_and_evaluation() -> None:
    model = _model(EVERY_LAYER)
    x = RNG.normal(size=(3, 6, 6, 2)).astype(np.float32)
    trained = model(x, training=True, weight=np.ones(3, np.float32), rows=np.arange(3), step=np.int64(1))
    assert trained.shape == (3, 4) and np.all(np.isfinite(trained.numpy()))
    assert model(x).shape == (3, 4)
    for name in ("weight", "rows", "step"):  # world 1 without a context: every row real, from 0
        assert model(x, training=True, **{name: None}).shape == (3, 4)


# --------------------------------------------------------------------------- batch norm

BATCHNORM = _plan([3, 4], [{"type": "batchnorm", "momentum": 0.8, "epsilon": 1e-3}])


def _batchnorm_reference(
    x: np.ndarray, weight: np.ndarray, weights: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(output, new moving mean, new moving variance) from docs/layers.md, in float64."""
    x, w = x.astype(np.float64), weight.astype(np.float64)[:, None, None]
    n = weight.sum() * x.shape[1]
    mean = (w * x).sum(axis=(0, 1)) / n
    variance = (w * (x - mean) ** 2).sum(axis=(0, 1)) / n
    output = (x - mean) / np.sqrt(variance + 1e-3) * weights["batchnorm_0.scale"] + weights[
        "batchnorm_0.offset"
    ]
    moving_mean = 0.8 * weights["batchnorm_0.moving_mean"] + 0.2 * mean
    moving_variance = 0.8 * weights["batchnorm_0.moving_variance"] + 0.2 * variance * n / (n - 1)
    return output, moving_mean, moving_variance


def test_batchnorm_trains_on_the_real_rows_and_moves_its_statistics() -> None:
    weights = _random_weights(BATCHNORM)
    model = _model(BATCHNORM, weights)
    x = RNG.normal(2.0, 3.0, size=(5, 3, 4)).astype(np.float32)
    weight = np.float32([1, 1, 0, 1, 1])
    output, moving_mean, moving_variance = _batchnorm_reference(x, weight, weights)
    _close(model(x, training=True, weight=weight).numpy()[weight == 1], output[weight == 1])
    state = neutral_state(model, BATCHNORM)
    _close(state["batchnorm_0.moving_mean"], moving_mean)
    _close(state["batchnorm_0.moving_variance"], moving_variance)
    # evaluation normalises with the moving statistics and leaves them alone
    expected = (x - moving_mean) / np.sqrt(moving_variance + 1e-3) * weights["batchnorm_0.scale"]
    _close(model(x, training=False), expected + weights["batchnorm_0.offset"])
    after = neutral_state(model, BATCHNORM)
    assert np.array_equal(after["batchnorm_0.moving_mean"], state["batchnorm_0.moving_mean"])


def test_a_padding_row_changes_nothing_and_gets_no_gradient() -> None:
    model = _model(BATCHNORM)
    x = RNG.normal(size=(4, 3, 4)).astype(np.float32)
    weight = np.float32([1, 0, 1, 1])
    changed = x.copy()
    changed[1] = 1e3
    first = model(x, training=True, weight=weight).numpy()
    second = model(changed, training=True, weight=weight).numpy()
    _close(second[weight == 1], first[weight == 1])
    inputs = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        loss = tf.reduce_sum(model(inputs, training=True, weight=weight) * weight[:, None, None] ** 2)
    gradient = tape.gradient(loss, inputs).numpy()
    assert np.all(gradient[1] == 0) and np.any(gradient[0] != 0)


def test_a_micro_batch_of_padding_alone_leaves_the_statistics_alone() -> None:
    weights = _random_weights(BATCHNORM)
    model = _model(BATCHNORM, weights)
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    output = model(x, training=True, weight=np.zeros(2, np.float32))
    assert np.all(np.isfinite(output.numpy()))
    state = neutral_state(model, BATCHNORM)
    for name in ("batchnorm_0.moving_mean", "batchnorm_0.moving_variance"):
        assert np.array_equal(state[name], weights[name]), name


# --------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_masks_are_the_numpy_reference_bit_for_bit(rate: float) -> None:
    rows = np.array([0, 5, 31, 2**32 + 7, 123_456_789_012], np.int64)  # beyond 32 bits: masked
    for seed, step, layer in ((0, 0, 0), (2**40 + 3, 2**33 + 1, 17), (12345, 999, 4)):
        expected = neutral_dropout.keep_mask(seed, step, layer, rows, 37, rate)
        actual = keep_mask(seed, tf.constant(step, tf.int64), layer, tf.constant(rows), 37, rate)
        assert np.array_equal(actual.numpy(), expected)
        assert abs(expected.mean() - (1 - rate)) < 0.15


def test_dropout_scales_what_it_keeps_and_only_in_training() -> None:
    plan = _plan([2, 3], [{"type": "tanh"}, {"type": "dropout", "rate": 0.25}], seed=7)
    model = _model(plan)
    x = RNG.normal(size=(4, 2, 3)).astype(np.float32)
    rows = np.array([8, 9, 10, 11], np.int64)
    keep = neutral_dropout.keep_mask(7, 3, 1, rows, 6, 0.25).reshape(4, 2, 3)
    expected = (np.tanh(x) * keep) * np.float32(1 / 0.75)
    _close(model(x, training=True, rows=rows, step=np.int64(3)), expected)
    assert 0 < keep.sum() < keep.size
    _close(model(x), np.tanh(x))


# --------------------------------------------------------------------------- sequences


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=-1, keepdims=True))


def _attention_reference(x: np.ndarray, w: dict[str, np.ndarray], heads: int, causal: bool) -> np.ndarray:
    batch, length, units = x.shape
    depth = units // heads

    def split(projection: str) -> np.ndarray:
        projected = x @ w[f"att.{projection}_kernel"] + w[f"att.{projection}_bias"]
        return np.asarray(projected.reshape(batch, length, heads, depth).transpose(0, 2, 1, 3))

    scores = split("query") @ split("key").transpose(0, 1, 3, 2) / math.sqrt(depth)
    if causal:
        scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    attended = (_softmax(scores) @ split("value")).transpose(0, 2, 1, 3).reshape(batch, length, units)
    return np.asarray(attended @ w["att.output_kernel"] + w["att.output_bias"])


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_numpy(causal: bool) -> None:
    plan = _plan([5, 6], [{"type": "attention", "heads": 3, "causal": causal, "name": "att"}])
    weights = _random_weights(plan)
    model = _model(plan, weights)
    x = RNG.normal(size=(2, 5, 6)).astype(np.float32)
    as64 = {name: value.astype(np.float64) for name, value in weights.items()}
    _close(model(x), _attention_reference(x.astype(np.float64), as64, 3, causal))
    later = x.copy()
    later[:, 3:] += 5.0
    earlier_unchanged = np.allclose(model(later).numpy()[:, :3], model(x).numpy()[:, :3], atol=1e-6)
    assert earlier_unchanged == causal  # a causal position never sees a later one


def test_embeddings_look_up_ids_and_add_positions() -> None:
    plan = _plan(
        [4],
        [{"type": "embedding", "vocab_size": 9, "units": 3}, {"type": "position_embedding"}],
        input_dtype="int32",
    )
    weights = _random_weights(plan)
    ids = RNG.integers(0, 9, size=(5, 4)).astype(np.int32)
    expected = weights["embedding_0.table"][ids] + weights["position_embedding_1.table"]
    _close(_model(plan, weights)(ids), expected)


# --------------------------------------------------------------------------- pooling, merges


def test_pools_merges_and_dense_on_the_last_axis_match_numpy() -> None:
    plan = _plan(
        [4, 6, 2],
        [
            {"type": "avgpool2d", "pool_size": 2, "strides": 1, "name": "avg"},
            {"type": "global_avg_pool2d", "inputs": ["input"], "name": "gap"},
            {"type": "add", "inputs": ["gap", "gap", "gap"], "name": "triple"},
            {"type": "concat", "inputs": ["triple", "gap"], "name": "joined"},
            {"type": "dense", "units": 3, "inputs": ["avg"], "name": "pixels"},
        ],
    )
    weights = _random_weights(plan)
    x = RNG.normal(size=(2, 4, 6, 2)).astype(np.float32)
    model = _model(plan, weights)
    layers = {layer.name: layer for layer in model.node_layers}
    avg = np.stack(
        [np.stack([x[:, i : i + 2, j : j + 2].mean(axis=(1, 2)) for j in range(5)], 1) for i in range(3)], 1
    )
    gap = x.mean(axis=(1, 2))
    # the graph's output is its last node (dense on [h, w, c]); the merges are checked
    # on the model's own layers
    _close(model(x), avg @ weights["pixels.kernel"] + weights["pixels.bias"])
    _close(layers["avg"](x), avg)
    _close(layers["gap"](x), gap)
    _close(layers["joined"]([layers["triple"]([gap, gap, gap]), gap]), np.concatenate([3 * gap, gap], -1))


def test_conv2d_takes_a_kernel_and_strides_per_axis() -> None:
    plan = _plan([5, 6, 2], [{"type": "conv2d", "filters": 3, "kernel_size": [3, 2], "strides": [2, 1]}])
    weights = _random_weights(plan)
    kernel, bias = weights["conv2d_0.kernel"], weights["conv2d_0.bias"]
    x = RNG.normal(size=(2, 5, 6, 2)).astype(np.float32)
    expected = np.stack(
        [
            np.stack([np.einsum("nhwc,hwcf->nf", x[:, i : i + 3, j : j + 2], kernel) for j in range(5)], 1)
            for i in range(0, 3, 2)
        ],
        axis=1,
    )
    _close(_model(plan, weights)(x), expected + bias)


# --------------------------------------------------------------------------- losses


def test_cross_entropy_sums_a_row_s_positions_and_counts_its_hits() -> None:
    logits = RNG.normal(size=(3, 4, 5)).astype(np.float32)
    targets = RNG.integers(0, 5, size=(3, 4)).astype(np.int64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0].sum(1)
    _close(per_row_loss(LossSpec(), tf.constant(logits), tf.constant(targets)), expected)
    # label smoothing 0.1: 0.9 on the label's log-probability, 0.1 on the classes' mean
    picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    smoothed = -(0.9 * picked + 0.1 * log_probs.mean(-1)).sum(1)
    _close(per_row_loss(LossSpec(label_smoothing=0.1), tf.constant(logits), tf.constant(targets)), smoothed)
    plan = _plan([5], [{"type": "dense", "units": 5}], top_k=2)
    hits = (logits.argmax(-1) == targets).sum(1)
    assert np.array_equal(correct_per_row(tf.constant(logits), tf.constant(targets), plan).numpy(), hits)
    above = (logits > np.take_along_axis(logits, targets[..., None], -1)).sum(-1)
    top_2 = top_k_per_row(tf.constant(logits), tf.constant(targets), plan).numpy()
    assert np.array_equal(top_2, (above < 2).sum(1))


def test_mse_averages_a_row_s_outputs() -> None:
    outputs = RNG.normal(size=(3, 2, 2)).astype(np.float32)
    targets = RNG.normal(size=(3, 4)).astype(np.float32)
    expected = ((outputs.reshape(3, 4) - targets) ** 2).mean(1)
    _close(per_row_loss(LossSpec(name="mse"), tf.constant(outputs), tf.constant(targets)), expected)


def test_binary_cross_entropy_averages_each_output_s_sigmoid_loss() -> None:
    logits = (RNG.normal(size=(3, 4)) * 5).astype(np.float32)
    targets = RNG.integers(0, 2, size=(3, 4)).astype(np.float32)
    probability = 1 / (1 + np.exp(-logits.astype(np.float64)))
    expected = -(targets * np.log(probability) + (1 - targets) * np.log1p(-probability)).mean(1)
    loss = LossSpec(name="binary_cross_entropy")
    _close(per_row_loss(loss, tf.constant(logits), tf.constant(targets)), expected)


# --------------------------------------------------------------------------- through the strategy

TOKENS = _plan(
    [6],
    [
        {"type": "embedding", "vocab_size": 7, "units": 4},
        {"type": "attention", "heads": 2, "causal": True},
        {"type": "batchnorm", "name": "bn"},
        {"type": "dropout", "rate": 0.2},
        {"type": "dense", "units": 7},
    ],
    input_dtype="int32",
    optimizer={"name": "sgd", "momentum": 0.9},
    metrics=["loss", "accuracy"],
)


def test_a_token_step_trains_embeddings_normalises_by_targets_and_counts_positions() -> None:
    strategy = TfStrategy(World())
    weights = TOKENS.model.graph().init_weights(0)
    state = strategy.build(TOKENS, weights)
    assert len(state.slots) == len(state.model.trainable_variables)  # moving statistics have none
    assert not any("moving" in v.path for v in state.model.trainable_variables)
    x = RNG.integers(0, 5, size=(4, 6)).astype(np.int32)  # ids 5 and 6 never occur
    y = RNG.integers(0, 7, size=(4, 6)).astype(np.int64)
    weight = np.float32([1, 1, 1, 0])
    batch = Batch(x, y, weight)
    before = strategy.eval_step(state, batch)
    assert before["count"] == 3 * 6
    step = StepBatch((batch,), 3, step=0, targets_per_row=6)
    loss = float(strategy.train_step(state, step, lr=0.1)["loss"])
    # the step's loss is the mean over real target positions: the eval loss before the step
    # (dropout aside), so both normalise by positions, not rows
    assert 0.5 * before["loss_sum"] / 18 < loss < 2.0 * before["loss_sum"] / 18
    after = strategy.state_dict(state)
    assert sorted(after) == sorted(weights)
    table = after["embedding_0.table"] - weights["embedding_0.table"]
    assert np.all(table[5:] == 0) and np.any(table != 0)  # a sparse gradient, made dense
    assert not np.array_equal(after["bn.moving_mean"], weights["bn.moving_mean"])
    strategy.load_state_dict(state, weights)
    restored = strategy.state_dict(state)
    for name, value in weights.items():
        assert np.array_equal(restored[name], value), name
