"""``train.shard``: a closed table in the plan, left out of plan.json at its default and out
of the plan hash always (a run may continue sharded another way), and refused before
launch, in one line naming it, on a backend that does not declare the mode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from crosstrain.core.admission.checks import admit
from crosstrain.core.admission.runfolder import MAY_CHANGE
from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import build_graph
from crosstrain.core.model.layers import Block, Dense, Embedding, ReLU
from crosstrain.core.run.checkpoint import StreamedTensors, load_checkpoint, plan_hash, write_safetensors
from crosstrain.core.run.job import Job, Layout
from crosstrain.core.run.rank_usage import largest_rank_memory
from crosstrain.core.spec.plan_dicts import unstructure_plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, Vocabulary
from crosstrain.testing.null import NullStrategy


class ShardsFully(NullStrategy):
    """Declares "full", and says why it has no "optimizer"."""

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        return attrs.evolve(
            CORE_VOCABULARY,
            shard=frozenset({"none", "full"}),
            unsharded=(("optimizer", "no flat view of the slots here"),),
        )


class Replicates(NullStrategy):
    """A third-party backend that declares no vocabulary at all."""

    vocabulary = None  # type: ignore[assignment]


def test_the_default_stays_out_of_plan_json_and_no_mode_changes_the_hash(
    write_plan: Callable[..., Path],
) -> None:
    plan = load_plan(write_plan())
    assert plan.train.shard == "none"
    assert "shard" not in unstructure_plan(plan)["train"]  # runs written before it hash alike
    full = load_plan(write_plan(), ("train.shard='full'",))
    assert unstructure_plan(full)["train"]["shard"] == "full"
    assert plan_hash(full) == plan_hash(plan)  # a checkpoint resumes sharded another way
    assert "train.shard" in MAY_CHANGE


def test_a_mode_outside_the_table_is_refused_naming_the_field(write_plan: Callable[..., Path]) -> None:
    with pytest.raises(PlanError, match=r"train\.shard: must be one of 'none', 'optimizer', 'full'"):
        load_plan(write_plan(), ("train.shard='zero3'",))


@pytest.mark.parametrize(
    ("strategy", "mode", "refusal"),
    [
        (NullStrategy(), "full", "not implemented on this backend yet (it trains with 'none')"),
        (ShardsFully(), "optimizer", "no flat view of the slots here (it trains with 'none', 'full')"),
        (Replicates(), "full", "it declares no shard modes (no vocabulary()), so it only replicates"),
    ],
)
def test_admission_refuses_a_mode_the_backend_does_not_declare_in_one_line(
    write_plan: Callable[..., Path], tmp_path: Path, strategy: Any, mode: str, refusal: str
) -> None:
    job = Job(
        plan=load_plan(write_plan(), (f"train.shard='{mode}'",)),
        layout=Layout("null", 2),
        out_dir=str(tmp_path / "run"),
    )
    with pytest.raises(PlanError) as refused:
        admit(job, strategy)
    line = str(refused.value)
    assert "\n" not in line and f"train.shard: the null backend has no shard mode '{mode}': {refusal}" in line
    assert not (tmp_path / "run").exists()
    admit(attrs.evolve(job, plan=load_plan(write_plan())), strategy)  # "none": every backend


def test_the_units_are_the_block_repeats_with_ties_left_in_the_root() -> None:
    layers = (
        Embedding(vocab_size=8, units=4, name="tokens"),
        Block(block="decoder", repeat=2),
        Dense(units=8, use_bias=False, tie="tokens"),
    )
    blocks = {"decoder": (Dense(units=4), ReLU(), Dense(units=4))}
    graph = build_graph((3,), layers, blocks, "int32")
    repeats = [[node.path for node in repeat] for repeat in graph.block_repeats()]
    assert repeats == [
        ["block_1.0.dense_0", "block_1.0.relu_1", "block_1.0.dense_2"],
        ["block_1.1.dense_0", "block_1.1.relu_1", "block_1.1.dense_2"],
    ]


def test_streamed_tensors_are_written_one_at_a_time_as_safetensors_reads_them(tmp_path: Path) -> None:
    tensors = {"a.kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3.0)}
    read: list[str] = []

    def gather(name: str) -> np.ndarray:
        read.append(name)
        return tensors[name]

    streamed = StreamedTensors({name: (value.shape, value.dtype) for name, value in tensors.items()}, gather)
    write_safetensors(tmp_path / "w.safetensors", streamed, {"step": "1"})
    assert read == ["a.kernel", "b"]  # each once, in order
    back = load_checkpoint(tmp_path / "w.safetensors")
    assert {name: value.tolist() for name, value in back.items()} == {
        name: value.tolist() for name, value in tensors.items()
    }
    assert back["b"].dtype == np.float64


def test_memory_per_rank_is_the_rank_holding_the_most() -> None:
    mine = {"parameters": 4, "gradients": 4, "optimizer": 2}  # rank 0: 10 bytes
    others = np.array([[0, 0, 0], [5, 5, 1]], np.float64)  # rank 1: 11 bytes
    largest = largest_rank_memory(lambda table: table + others, 0, 2, mine)
    assert largest == {"parameters": 5, "gradients": 5, "optimizer": 1}
