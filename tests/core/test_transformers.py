"""The vocabulary of today's transformers, in core: RMS norm, grouped-query rotary attention
with a padding mask, the class token, weight tying; binary cross-entropy, label smoothing,
the top-k accuracy and perplexity; weight decay on kernels only. Shapes, weights and every
refusal before any process starts (what each backend computes: the layer parity cases)."""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.data.batches import ArrayDataset
from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import build_graph
from crosstrain.core.model.layers import Attention, ClassToken, Dense, Embedding, RMSNorm
from crosstrain.core.model.layers.sequences import rotary_tables
from crosstrain.core.model.optimizers import DECAY, DECAY_MODES, decayed_weights
from crosstrain.core.run.checkpoint import plan_hash
from crosstrain.core.run.evaluation import evaluate, perplexity
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, Vocabulary, check_plan_vocabulary
from crosstrain.describe import describe_graph
from crosstrain.testing.data_plans import MULTILABEL_PLAN
from crosstrain.testing.null import NullStrategy
from crosstrain.testing.plans import DIGITS_MLP_PLAN, GPT2_PLAN, GPT_PLAN, LLAMA_PLAN


def test_a_llama_decoder_has_grouped_rotary_attention_and_a_tied_output(
    write_plan: Callable[..., Path],
) -> None:
    graph = load_plan(write_plan(LLAMA_PLAN)).model.graph()
    specs = graph.weight_specs()
    # 4 query heads of 8 units; 2 key/value heads: key and value kernels [32, 16], no biases
    assert specs["block_1.0.attention_1.query_kernel"].shape == (32, 32)
    assert (
        specs["block_1.0.attention_1.key_kernel"].shape
        == specs["block_1.0.attention_1.value_kernel"].shape
        == (32, 16)
    )
    assert not any(name.endswith("_bias") for name in specs)
    assert specs["block_1.0.rmsnorm_0.scale"].shape == (32,)
    # the output has no kernel of its own: it reads the token table, transposed
    (head,) = (node for node in graph.nodes if node.tied_to is not None)
    assert graph.tied_table(head) == "tokens.table"
    assert not any(name.startswith(head.path) for name in specs)
    assert graph.output_shape == (32, 256)


def test_describe_counts_a_tied_table_once(write_plan: Callable[..., Path]) -> None:
    """GPT-2 small's 124,439,808 parameters count wte once; so does describe here."""
    description = describe_graph(load_plan(write_plan(GPT2_PLAN)).model.graph())
    rows = {row.name: row for row in description.rows}
    assert rows["dense_5"].parameters == 256  # the bias alone
    assert rows["dense_5"].type == "dense (tied to embedding_0)"
    untied = describe_graph(
        load_plan(write_plan(GPT2_PLAN.replace(', tie = "embedding_0"', ""))).model.graph()
    )
    assert untied.parameters - description.parameters == 32 * 256


GPT2_SMALL = """
[model]
input_shape = [1024]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 50257, units = 768, name = "wte" },
  { type = "position_embedding" },
  { type = "block", block = "h", repeat = 12 },
  { type = "layernorm" },
  { type = "dense", units = 50257, use_bias = false, tie = "wte" },
]
[model.blocks.h]
layers = [
  { type = "layernorm" },
  { type = "attention", heads = 12, causal = true, name = "attn" },
  { type = "add", inputs = ["input", "attn"], name = "mid" },
  { type = "layernorm" },
  { type = "dense", units = 3072, activation = "gelu" },
  { type = "dense", units = 768, name = "mlp" },
  { type = "add", inputs = ["mid", "mlp"] },
]
"""


def test_gpt2_small_with_tied_embeddings_has_hugging_face_s_parameter_count(
    write_plan: Callable[..., Path],
) -> None:
    """GPT2LMHeadModel (vocabulary 50,257): 124,439,808 parameters, wte counted once."""
    description = describe_graph(load_plan(write_plan(GPT2_SMALL)).model.graph())
    assert description.parameters == 124_439_808


def test_attention_s_weights_and_multiply_adds_follow_its_heads() -> None:
    grouped = Attention(heads=4, kv_heads=1, use_bias=False)
    assert {name: spec.shape for name, spec in grouped.weight_specs((10, 16)).items()} == {
        "query_kernel": (16, 16),
        "key_kernel": (16, 4),
        "value_kernel": (16, 4),
        "output_kernel": (16, 16),
    }
    # projections 2 x 10 x 16 x (16 + 4), scores and weighted sum 2 x 10 x 10 x 16
    assert grouped.multiply_adds((10, 16)) == 2 * 10 * 16 * 20 + 2 * 10 * 10 * 16
    # without kv_heads: today's attention, its weights as before
    plain = Attention(heads=4)
    assert plain.multiply_adds((10, 16)) == 4 * 10 * 16 * 16 + 2 * 10 * 10 * 16
    assert sorted(plain.weight_specs((10, 16))) == sorted(
        f"{projection}_{param}"
        for projection in ("query", "key", "value", "output")
        for param in ("kernel", "bias")
    )


def test_rotary_tables_turn_the_half_split_pairs() -> None:
    """Position p turns the pair (i, i + d/2) by p x base^(-2i/d): GPT-NeoX's and Hugging
    Face Llama's rotate_half convention."""
    cos, sin = rotary_tables(length=5, head_units=8, base=100.0)
    assert cos.shape == sin.shape == (5, 8) and cos.dtype == np.float32
    angles = np.arange(5)[:, None] * 100.0 ** (-np.arange(4) * 2 / 8)[None, :]
    np.testing.assert_allclose(cos[:, :4], np.cos(angles), rtol=1e-6)
    np.testing.assert_array_equal(cos[:, 4:], cos[:, :4])  # each pair's two halves turn alike
    np.testing.assert_allclose(sin[:, 4:], np.sin(angles), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(sin[0], np.zeros(8))  # position 0 is not turned


ENCODER = """
[model]
input_shape = [12]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 50, units = 16, name = "tokens" },
  { type = "padding_mask", inputs = ["input"], name = "mask" },
  { type = "block", block = "encoder", repeat = 2, inputs = ["tokens", "mask"] },
  { type = "dense", units = 3 },
]
[model.blocks.encoder]
layers = [
  { type = "attention", heads = 2, inputs = ["input", "mask"], name = "att" },
  { type = "add", inputs = ["input", "att"] },
  { type = "layernorm" },
]
"""


def test_a_padding_mask_reaches_every_repeat_of_a_block_as_its_side_input(
    write_plan: Callable[..., Path],
) -> None:
    graph = load_plan(write_plan(ENCODER)).model.graph()
    by_path = {node.path: node for node in graph.nodes}
    mask = by_path["mask"].index
    first, second = by_path["block_2.0.att"], by_path["block_2.1.att"]
    assert first.inputs == (by_path["tokens"].index, mask)
    assert second.inputs == (by_path["block_2.0.layernorm_2"].index, mask)  # the repeat before
    with pytest.raises(PlanError, match=r"layers\[2\]\.inputs: block takes 1 input \(then optionally a side"):
        load_plan(
            write_plan(ENCODER.replace('inputs = ["tokens", "mask"]', 'inputs = ["tokens", "mask", "mask"]'))
        )


def test_rmsnorm_and_the_class_token_shapes_and_weights() -> None:
    graph = build_graph((6, 4), (ClassToken(), RMSNorm()))
    assert [node.output_shape for node in graph.nodes] == [(7, 4), (7, 4)]
    weights = graph.init_weights(0)
    assert weights["class_token_0.token"].tolist() == [[0.0] * 4]  # torchvision's start
    assert weights["rmsnorm_1.scale"].tolist() == [1.0] * 4


LLAMA_LAYER = (
    '{ type = "attention", heads = 4, kv_heads = 2, causal = true, rotary = true, use_bias = false }'
)
BAD_TRANSFORMERS = [
    (
        LLAMA_LAYER.replace("kv_heads = 2", "kv_heads = 3"),
        r"model\.blocks\.decoder\.layers\[1\]: 'kv_heads' \(3\) must divide 'heads' \(4\)",
    ),
    (
        LLAMA_LAYER.replace("heads = 4, kv_heads = 2", "heads = 32, kv_heads = 4"),
        r"layers\[1\]: layer 'attention_1': rotary needs an even number of units per head, got 1",
    ),
    (
        LLAMA_LAYER.replace("false", 'false, inputs = ["input", "input"]'),
        r"layers\[1\]: layer 'attention_1': the padding mask must be \[length\] = \[32\], got \[32, 32\]",
    ),
    (
        LLAMA_LAYER.replace("false", 'false, inputs = ["input", "input", "input"]'),
        r"layers\[1\]\.inputs: attention takes 1 input \(then optionally a padding mask \[length\]\), got 3",
    ),
]


@pytest.mark.parametrize(("layer", "message"), BAD_TRANSFORMERS)
def test_a_bad_attention_is_refused_naming_its_field(
    write_plan: Callable[..., Path], layer: str, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        load_plan(write_plan(LLAMA_PLAN.replace(LLAMA_LAYER, layer)))


HEAD = '{ type = "dense", units = 256, use_bias = false, tie = "tokens" }'
BAD_TIES = [
    (HEAD.replace('"tokens"', '"nosuch"'), r"layers\[3\]\.tie: tie names 'nosuch', but no earlier embedding"),
    # a block's name stands for its last node, not an embedding
    (HEAD.replace('"tokens"', '"block_1"'), r"layers\[3\]\.tie: tie names 'block_1', but no earlier"),
    (
        HEAD.replace("256", "255"),
        r"layers\[3\]\.units: a dense tied to 'tokens' has units = its vocab_size \(256\)",
    ),
]


@pytest.mark.parametrize(("head", "message"), BAD_TIES)
def test_a_bad_tie_is_refused_naming_its_field(
    write_plan: Callable[..., Path], head: str, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        load_plan(write_plan(LLAMA_PLAN.replace(HEAD, head)))


def test_a_tied_dense_reads_the_embedding_s_units() -> None:
    layers = (Embedding(vocab_size=9, units=4, name="tokens"), Dense(units=5), Dense(units=9, tie="tokens"))
    with pytest.raises(PlanError, match=r"reads 5 features, but the embedding it is tied to has 4 units"):
        build_graph((3,), layers, input_dtype="int32")


LOSS_AND_METRIC_PROBLEMS = [
    (
        DIGITS_MLP_PLAN,
        ["loss.name='mse'", "loss.label_smoothing=0.1"],
        r"loss: label_smoothing smooths cross",
    ),
    (DIGITS_MLP_PLAN, ["loss.label_smoothing=1.0"], r"loss\.label_smoothing: must be < 1"),
    (DIGITS_MLP_PLAN, ["metrics=['loss', 'perplexity']", "loss.label_smoothing=0.1"], r"metrics: perplexity"),
    (DIGITS_MLP_PLAN, ["metrics=['top_k_accuracy']", "top_k=11"], r"top_k: top_k 11 exceeds the 10 classes"),
    (DIGITS_MLP_PLAN, ["metrics=['top_k_accuracy']", "top_k=0"], r"top_k: must be > 0"),
    (
        MULTILABEL_PLAN,
        ["metrics=['loss', 'top_k_accuracy']"],
        r"metrics: top_k_accuracy needs loss 'cross_entropy'",
    ),
    (DIGITS_MLP_PLAN, ["metrics=['recall']"], r"metrics\[0\]: must be one of 'loss', 'accuracy'"),
    (DIGITS_MLP_PLAN, ["optimizer.decay='norms'"], r"optimizer\.decay: must be one of 'all', 'kernels'"),
]


@pytest.mark.parametrize(("text", "overrides", "message"), LOSS_AND_METRIC_PROBLEMS)
def test_losses_metrics_and_decay_are_checked_before_anything_starts(
    write_plan: Callable[..., Path], text: str, overrides: list[str], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        load_plan(write_plan(text), overrides)


def test_binary_cross_entropy_takes_float_targets_in_0_1(
    tmp_path: Path, write_plan: Callable[..., Path]
) -> None:
    x = np.zeros((10, 64), np.float32)
    np.savez(tmp_path / "multilabel.npz", x=x, y=np.ones((10, 4), np.float32))
    datasets = load_datasets(load_plan(write_plan(MULTILABEL_PLAN)))
    assert datasets.train.y.dtype == np.float32 and datasets.train.targets_per_row == 1
    np.savez(tmp_path / "multilabel.npz", x=x, y=np.full((10, 4), 2.0, np.float32))
    with pytest.raises(
        PlanError, match=r"data\.y_key: binary_cross_entropy needs targets in \[0, 1\].*\[2, 2\]"
    ):
        load_datasets(load_plan(write_plan(MULTILABEL_PLAN)))


def test_kernels_decay_and_biases_norms_and_tables_do_not(write_plan: Callable[..., Path]) -> None:
    assert tuple(DECAY) == DECAY_MODES == ("all", "kernels")
    specs = load_plan(write_plan(GPT2_PLAN)).model.graph().weight_specs()
    decayed = decayed_weights(specs, "kernels")
    assert decayed == {name for name in specs if name.endswith("kernel")}
    assert "block_3.0.att.query_kernel" in decayed and "block_3.0.dense_5.kernel" in decayed
    for kept in ("embedding_0.table", "position_embedding_1.table", "dense_5.bias", "layernorm_4.scale"):
        assert kept in specs and kept not in decayed
    assert decayed_weights(specs, "all") == set(specs)


def test_the_newer_fields_stay_out_of_plan_json_at_their_defaults(write_plan: Callable[..., Path]) -> None:
    """Checkpoints of plans written before these fields hold the same plan hash, so they
    still resume; set, every field round-trips."""
    # the hashes of these plans before the fields existed (data paths as written)
    assert plan_hash(structure_plan(tomllib.loads(GPT_PLAN))) == "730a3e172dbdac57"
    assert plan_hash(structure_plan(tomllib.loads(DIGITS_MLP_PLAN))) == "62f6b8e74c069c54"
    raw = unstructure_plan(load_plan(write_plan(GPT_PLAN)))
    attention = raw["model"]["blocks"]["decoder"]["layers"][1]
    assert sorted(attention) == ["causal", "heads", "name", "type"]
    assert "tie" not in json.dumps(raw["model"]["layers"])
    assert "label_smoothing" not in raw["loss"] and "decay" not in raw["optimizer"] and "top_k" not in raw
    llama = load_plan(write_plan(LLAMA_PLAN))
    assert structure_plan(unstructure_plan(llama)) == llama


def test_a_backend_that_counts_no_top_k_or_decays_everything_refuses_them(
    write_plan: Callable[..., Path],
) -> None:
    older = Vocabulary.of(
        CORE_VOCABULARY.layers, CORE_VOCABULARY.losses, CORE_VOCABULARY.optimizers, CORE_VOCABULARY.precisions
    )
    plan = load_plan(write_plan(LLAMA_PLAN))
    with pytest.raises(PlanError, match=r"metrics: the old backend has no metric 'top_k_accuracy'"):
        check_plan_vocabulary(plan, older, "old")
    plan = load_plan(write_plan(LLAMA_PLAN), ["metrics=['loss', 'accuracy']"])
    with pytest.raises(PlanError, match=r"optimizer\.decay: the old backend has no decay mode 'kernels'"):
        check_plan_vocabulary(plan, older, "old")


class _CountingEval(NullStrategy):
    """Every eval batch: loss 2 a target, 3 of 4 in the top k."""

    def eval_step(self, state: object, batch: object) -> dict[str, float]:
        return {"loss_sum": 8.0, "correct": 1.0, "top_k_correct": 3.0, "count": 4.0}


def test_evaluate_reports_the_top_k_accuracy_and_perplexity(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan(), ["metrics=['loss', 'top_k_accuracy', 'perplexity']", "top_k=3"])
    rows = ArrayDataset(np.zeros((10, 64), np.float32), np.zeros(10, np.int64))
    metrics = evaluate(_CountingEval(), {}, rows, plan)
    assert metrics == {"loss": 2.0, "count": 4.0, "top_k_accuracy": 0.75, "perplexity": math.exp(2.0)}
    assert perplexity(800.0) == math.inf and math.isnan(perplexity(math.nan))
