"""Every shipped example plan loads, validates and fits its data (no framework needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from crosstrain.core.data import load_datasets
from crosstrain.core.plan import check_world_fits, load_plan
from tests.conftest import EXAMPLES

PLANS = sorted(EXAMPLES.glob("*.toml")) + sorted(EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("path", PLANS, ids=lambda path: path.name)
def test_example_plan_is_valid(path: Path) -> None:
    plan = load_plan(path)
    check_world_fits(plan, 2)  # the README runs every example with --nproc 2
    data = load_datasets(plan)
    assert data.train.x.shape[1:] == plan.model.input_shape


def test_there_are_toml_and_python_examples() -> None:
    assert {path.suffix for path in PLANS} == {".toml", ".py"}
