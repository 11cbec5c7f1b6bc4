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

from jaxtest_support import MLP_PLAN, TOKEN_PLAN

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


@pytest.fixture
def token_plan(write_plan: Callable[..., Path], tmp_path: Path) -> Path:
    """TOKEN_PLAN on 6,400 tokens (399 windows of 16): a repeating pattern of 12 ids with 10 %
    of the positions replaced by random ids below 32, so there is something to learn."""
    rng = np.random.default_rng(0)
    pattern = np.tile(np.arange(32) % 12, 200)
    noise = rng.integers(0, 32, size=pattern.size)
    tokens = np.where(rng.random(pattern.size) < 0.1, noise, pattern).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    return write_plan(
        TOKEN_PLAN.replace("TOKEN_FILE", str(tmp_path / "tokens.npy")), name="tokens.toml"
    )
