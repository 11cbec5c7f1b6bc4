"""A plan is checked against the chosen backend's tables before anything starts."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.model.optimizers import OPTIMIZER_SLOTS, OPTIMIZERS
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import CORE_VOCABULARY, Vocabulary, check_plan_vocabulary, missing_names
from crosstrain.testing.plans import GPT_PLAN
from tests.conftest import REPO

WITHOUT_ATTENTION = Vocabulary.of(
    CORE_VOCABULARY.layers - {"attention"}, CORE_VOCABULARY.losses, {"sgd", "adam"}, {"fp32"}
)


def test_the_first_missing_name_is_refused_naming_its_field(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan(GPT_PLAN))
    with pytest.raises(
        PlanError, match=r"model\.blocks\.decoder\.layers\[1\]: the mine backend has no 'attention'"
    ):
        check_plan_vocabulary(plan, WITHOUT_ATTENTION, "mine")


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optimizer.name='adamw'", "optimizer.name: the mine backend has no optimizer 'adamw'"),
        ("train.precision='bf16'", "train.precision: the mine backend has no precision 'bf16'"),
    ],
)
def test_optimizers_and_precisions_are_checked_too(
    write_plan: Callable[..., Path], override: str, field: str
) -> None:
    plan = load_plan(write_plan(), [override])
    with pytest.raises(PlanError, match=field):
        check_plan_vocabulary(plan, WITHOUT_ATTENTION, "mine")


def test_missing_names_lists_what_a_backend_lacks() -> None:
    assert missing_names(CORE_VOCABULARY) == {}
    assert missing_names(WITHOUT_ATTENTION) == {
        "layers": ["attention"],
        "optimizers": ["adamw"],
        "precisions": ["bf16", "fp16", "fp64"],
        "metrics": ["top_k_accuracy"],  # a backend that names no metrics counts accuracy alone
        "decay": ["kernels"],
    }


def test_every_core_optimizer_names_its_slots() -> None:
    """A checkpoint names each optimizer's slots the same on every backend: an optimizer
    added to core's names without its slots (or the reverse) fails here."""
    assert tuple(OPTIMIZER_SLOTS) == OPTIMIZERS
    assert all(slots and len(set(slots)) == len(slots) for slots in OPTIMIZER_SLOTS.values())


def _documented_slots() -> dict[str, tuple[str, ...]]:
    """docs/checkpoints.md's table: optimizer -> the slots it names (asides in parentheses
    left out)."""
    text = (REPO / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    table = text[text.index("| optimizer | slots |") :].split("\n\n")[0].splitlines()[2:]
    documented: dict[str, tuple[str, ...]] = {}
    for row in table:
        names, slots = (re.sub(r"\(.*?\)", "", cell) for cell in row.split("|")[1:3])
        for name in re.findall(r"`(\w+)`", names):
            documented[name] = tuple(re.findall(r"`(\w+)`", slots))
    return documented


def test_docs_checkpoints_md_names_every_optimizer_s_slots() -> None:
    assert _documented_slots() == OPTIMIZER_SLOTS
