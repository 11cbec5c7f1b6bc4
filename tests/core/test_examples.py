"""Every shipped example plan loads, validates and fits its data (no framework needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.plan import check_world_fits
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.plans import DIGITS_MLP_PLAN
from tests.conftest import EXAMPLES

PLANS = sorted(EXAMPLES.glob("*.toml")) + sorted(EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("path", PLANS, ids=lambda path: path.name)
def test_example_plan_is_valid(path: Path) -> None:
    plan = load_plan(path)
    check_world_fits(plan, 2)  # docs/plans.md: every example runs with --nproc 2
    data = load_datasets(plan)
    assert data.train.x.shape[1:] == plan.model.input_shape


def test_the_conformance_suite_trains_the_readmes_example_word_for_word() -> None:
    assert (EXAMPLES / "digits_mlp.toml").read_text() == DIGITS_MLP_PLAN


def test_there_are_toml_and_python_examples() -> None:
    assert {path.suffix for path in PLANS} == {".toml", ".py"}


def test_examples_and_readme_import_only_from_crosstrain_itself() -> None:
    """What users and backend authors need is exported by ``crosstrain``; what they copy
    from the examples, the README and the docs' recipes never reaches into ``crosstrain.core``."""
    recipes = ["plans.md", "running.md", "inference.md", "plugins.md", "checkpoints.md", "experiments.md"]
    shown = [EXAMPLES.parent / "README.md", EXAMPLES / "crosstrain-jax" / "README.md"]
    shown += [EXAMPLES.parent / "docs" / name for name in recipes]
    shown += sorted(EXAMPLES.glob("*.py")) + sorted((EXAMPLES / "crosstrain-jax" / "src").rglob("*.py"))
    offenders = [
        f"{path.relative_to(EXAMPLES.parent)}:{number}"
        for path in shown
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"(from|import) crosstrain\.core\b|crosstrain\.core\.\w", line)
    ]
    assert offenders == []


def test_the_public_names_cover_plans_plugins_and_backends() -> None:
    import crosstrain
    from crosstrain.core.model import layers
    from crosstrain.core.run import strategy

    assert all(hasattr(crosstrain, name) for name in crosstrain.__all__)
    public = set(crosstrain.__all__)
    layer_classes = {name for name, value in vars(layers).items() if _is_public_subclass(value, layers.Layer)}
    assert layer_classes <= public
    protocols = {
        name
        for name, value in vars(strategy).items()
        if getattr(value, "_is_protocol", False) and value.__module__ == strategy.__name__
    }
    assert protocols <= public, protocols - public
    assert {"RunContext", "PluginSelection", "Job", "World", "RunResult", "NativeModel", "fit"} <= public
    assert {"CrosstrainError", "PlanError", "BackendError", "WorkerError", "PluginError"} <= public


def _is_public_subclass(value: object, base: type) -> bool:
    return isinstance(value, type) and issubclass(value, base) and not value.__name__.startswith("_")
