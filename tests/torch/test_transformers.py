"""The torch backend's transformer vocabulary against numpy and against itself: grouped-query
rotary attention with a padding mask as Hugging Face's Llama computes it, a tied output
holding one weight that both uses train, and the optimizer groups of ``optimizer.decay``."""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import numpy as np
import pytest

from crosstrain.core.model.layers import Attention, Dense, Embedding, LayerNorm, PaddingMask
from crosstrain.core.spec.plan import ModelSpec, OptimizerSpec, Plan

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.export import export_torch  # noqa: E402
from crosstrain.backends.torch.model import (  # noqa: E402
    build_module,
    load_neutral,
    neutral_parameters,
    neutral_state,
    undecayed_parameters,
)
from crosstrain.backends.torch.optimizer import make_optimizer  # noqa: E402
from crosstrain.core.data.scaling import InputScaling  # noqa: E402

pytestmark = pytest.mark.torch

RNG = np.random.default_rng(17)


def _llama_attention(x: np.ndarray, weights: dict[str, np.ndarray], mask: np.ndarray) -> np.ndarray:
    """Hugging Face's LlamaAttention in float64 numpy: rotate_half on the half-split pairs with
    inv_freq = 1 / base^(arange(0, d, 2) / d), repeat_kv, a causal softmax, plus the padding
    mask's -1e9 on padded keys."""
    batch, length, units = x.shape
    heads, kv_heads, depth, base = 4, 2, 4, 50.0

    def split(name: str, count: int) -> np.ndarray:
        return (x @ weights[f"att.{name}_kernel"]).reshape(batch, length, count, depth).transpose(0, 2, 1, 3)

    query, key, value = split("query", heads), split("key", kv_heads), split("value", kv_heads)
    frequencies = 1.0 / base ** (np.arange(0, depth, 2) / depth)
    angles = np.concatenate([np.outer(np.arange(length), frequencies)] * 2, axis=-1)

    def rotate(t: np.ndarray) -> np.ndarray:
        half = np.concatenate([-t[..., depth // 2 :], t[..., : depth // 2]], axis=-1)
        return t * np.cos(angles) + half * np.sin(angles)

    query, key = rotate(query), rotate(key)
    key, value = (np.repeat(t, heads // kv_heads, axis=1) for t in (key, value))
    scores = query @ key.transpose(0, 1, 3, 2) / np.sqrt(depth) + (mask[:, None, None, :] - 1) * 1e9
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probabilities = np.exp(scores - scores.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    joined = (probabilities @ value).transpose(0, 2, 1, 3).reshape(batch, length, units)
    return np.asarray(joined @ weights["att.output_kernel"])


def test_grouped_rotary_attention_with_a_padding_mask_is_llama_s() -> None:
    layers = (
        Embedding(vocab_size=9, units=16, name="tokens"),
        PaddingMask(pad_id=0, inputs=("input",), name="mask"),
        Attention(
            heads=4, kv_heads=2, causal=True, rotary=True, rotary_base=50.0, use_bias=False,
            inputs=("tokens", "mask"), name="att",
        ),
    )  # fmt: skip
    plan = Plan(model=ModelSpec(input_shape=(6,), input_dtype="int32", layers=layers))
    weights = {name: RNG.normal(size=value.shape).astype(np.float32) * 0.5 for name, value in
               plan.model.graph().init_weights(0).items()}  # fmt: skip
    module = build_module(plan)
    load_neutral(module, plan, weights)
    ids = RNG.integers(1, 9, size=(3, 6)).astype(np.int32)
    ids[0, 2], ids[1, :2], ids[2, 0] = 0, 0, 0  # padding, among it a row's first key
    outputs = module(torch.from_numpy(ids)).detach().numpy()
    embedded = weights["tokens.table"][ids].astype(np.float64)
    expected = _llama_attention(embedded, weights, (ids != 0).astype(np.float64))
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)


TIED = Plan(
    model=ModelSpec(
        input_shape=(5,),
        input_dtype="int32",
        layers=(Embedding(vocab_size=7, units=4, name="tokens"), LayerNorm(), Dense(units=7, tie="tokens")),
    )
)


def test_a_tied_output_is_one_weight_that_both_uses_train() -> None:
    module = build_module(TIED)
    weights = {name: RNG.normal(size=value.shape).astype(np.float32) for name, value in
               TIED.model.graph().init_weights(0).items()}  # fmt: skip
    load_neutral(module, TIED, weights)
    # one table: no kernel of the dense among the parameters, the state or the checkpoint
    assert sorted(name for name, _ in module.named_parameters()) == [
        "nodes.dense_2.linear.bias", "nodes.layernorm_1.norm.bias", "nodes.layernorm_1.norm.weight",
        "nodes.tokens.table.weight",
    ]  # fmt: skip
    assert sorted(neutral_state(module, TIED)) == sorted(weights) == [
        "dense_2.bias", "layernorm_1.offset", "layernorm_1.scale", "tokens.table",
    ]  # fmt: skip
    ids = torch.from_numpy(RNG.integers(0, 7, size=(3, 5)).astype(np.int32))
    module(ids).square().sum().backward()
    # the same model untied, its kernel a copy of the table: the table's gradient is the sum
    # of the embedding's and the transposed kernel's
    untied_plan = attrs.evolve(
        TIED, model=attrs.evolve(TIED.model, layers=(*TIED.model.layers[:2], Dense(units=7)))
    )
    untied = build_module(untied_plan)
    load_neutral(untied, untied_plan, {**weights, "dense_2.kernel": weights["tokens.table"].T})
    untied(ids).square().sum().backward()
    tied_gradient = dict(module.named_parameters())["nodes.tokens.table.weight"].grad
    parameters = dict(untied.named_parameters())
    both = parameters["nodes.tokens.table.weight"].grad + parameters["nodes.dense_2.linear.weight"].grad
    torch.testing.assert_close(tied_gradient, both, rtol=1e-5, atol=1e-6)
    # a deep copy (what export takes) stays tied to its own table
    copied = copy.deepcopy(module)
    assert copied.nodes["dense_2"].tied[0] is copied.nodes["tokens"]


def test_a_tied_model_exports_as_one_program(tmp_path: Path) -> None:
    """torch.export captures the tied dense reading the embedding's table (export_torch
    checks the loaded program's outputs against the module's)."""
    sample = RNG.integers(0, 7, size=(4, 5)).astype(np.int32)
    scaling = InputScaling(1.0, (), ())
    _, state = export_torch(build_module(TIED).eval(), scaling, tmp_path / "export", sample)
    assert "nodes.dense_2.linear.weight" not in torch.load(str(state))


def test_decay_on_kernels_puts_biases_norms_and_tables_in_a_group_without_decay() -> None:
    plan = attrs.evolve(TIED, optimizer=OptimizerSpec(name="adamw", weight_decay=0.1, decay="kernels"))
    module = build_module(plan)
    names = {id(param): name for name, (param, _) in neutral_parameters(module, plan).items()}
    undecayed = undecayed_parameters(module, plan)
    # the tied model has no kernel at all: every weight is in the group without decay
    assert sorted(names[id(param)] for param in undecayed) == sorted(names.values())
    optimizer = make_optimizer(module, plan.optimizer, undecayed=undecayed)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.0]
    untied = attrs.evolve(
        plan, model=attrs.evolve(plan.model, layers=(*plan.model.layers[:2], Dense(units=7)))
    )
    module = build_module(untied)
    optimizer = make_optimizer(module, untied.optimizer, undecayed=undecayed_parameters(module, untied))
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert [param.shape for param in decayed["params"]] == [(7, 4)]  # the dense's kernel alone
    assert decayed["lr"] is kept["lr"]  # one learning rate, which the schedule sets
    assert undecayed_parameters(module, attrs.evolve(untied, optimizer=OptimizerSpec(weight_decay=0.1))) == []
