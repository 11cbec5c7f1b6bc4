"""Shared fixtures: small plans and data sets in tmp_path, a CLI runner, run readers.

The in-process tests use two CPU devices, which XLA only creates if told before jax
initialises; so the flag is set here, at collection, before any test imports jax.
(Runs through ``launch()`` set their own device count in their worker.)
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from jaxtest_support import MLP_PLAN

os.environ["XLA_FLAGS"] = " ".join(
    [*os.environ.get("XLA_FLAGS", "").split(), "--xla_force_host_platform_device_count=2"]
)
os.environ["JAX_PLATFORMS"] = "cpu"

@pytest.fixture
def write_plan(tmp_path: Path) -> Callable[..., Path]:
    """Write a TOML plan (dedented) into tmp_path and return its path."""

    def write(text: str = MLP_PLAN, name: str = "plan.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def odd_npz(tmp_path: Path) -> Path:
    """A 203-row classification set: not a multiple of any batch size the tests use."""
    rng = np.random.default_rng(7)
    path = tmp_path / "odd.npz"
    np.savez(path, x=rng.normal(size=(203, 64)).astype(np.float32), y=rng.integers(0, 10, size=203))
    return path
