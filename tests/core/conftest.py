"""The core tests' fixtures."""

from __future__ import annotations

import pytest

from crosstrain.core.data.sources import images


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch):
    """A fresh pool of two decoding worker processes (closed after the test)."""
    monkeypatch.setenv("CROSSTRAIN_DECODE_WORKERS", "2")
    monkeypatch.setattr(images, "_POOL", None)
    yield
    if images._POOL is not None:
        images._POOL.close()
