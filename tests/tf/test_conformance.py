"""The conformance suite every backend runs (crosstrain.testing), on tf."""

from __future__ import annotations

import pytest

from crosstrain.testing.conformance import BackendConformance

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


class TestTfConformance(BackendConformance):
    backend = "tf"
