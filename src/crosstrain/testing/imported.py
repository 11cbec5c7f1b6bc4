"""Checks of an imported model (``crosstrain import``), shared by every importer's tests: the
plan's outputs on a backend from the weights its ``model.init`` names, in this process, as
``crosstrain predict`` computes them (inference mode: dropout off, batch norm's moving
statistics), to compare with the framework's own forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from crosstrain.core.run.checkpoint import load_checkpoint, weights_file
from crosstrain.core.run.strategy import Predicts, RunsLocally
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan
from crosstrain.plugins.manager import get_backend, make_plugin_manager

#: the imported plan's forward equals the framework's within this, relative to the largest
#: output: float32 rounding through a network's depth, which stays well inside it
#: (docs/import.md lists each model's)
FORWARD_TOLERANCE = 1e-5


def imported_plan(plan_file: Path) -> tuple[Plan, dict[str, np.ndarray]]:
    """The plan and the weights its ``model.init`` names."""
    plan = load_plan(plan_file)
    assert plan.model.init is not None, f"{plan_file} names no model.init"
    return plan, load_checkpoint(weights_file(Path(plan.model.init)))


def plan_outputs(plan_file: Path, backend: str, x: np.ndarray) -> np.ndarray:
    """The outputs of the plan ``plan_file`` (its ``model.init`` weights) for the rows ``x``
    on ``backend``, world 1 on this process's CPU."""
    plan, weights = imported_plan(plan_file)
    backend_class = get_backend(make_plugin_manager(), backend)
    strategy = backend_class.local("cpu") if issubclass(backend_class, RunsLocally) else backend_class()
    assert isinstance(strategy, Predicts), f"the {backend} backend cannot predict"
    state = strategy.build(plan, weights)
    return np.asarray(strategy.predict(state, x))


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest |actual - expected| over the largest |expected|."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.abs(actual - expected).max() / max(float(np.abs(expected).max()), 1e-12))
