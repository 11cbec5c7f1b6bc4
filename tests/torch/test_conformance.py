"""The conformance suite every backend runs (crosstrain.testing), on torch."""

from __future__ import annotations

import pytest

from crosstrain.testing.conformance import BackendConformance
from crosstrain.testing.fault_matrix import FaultConformance

pytest.importorskip("torch")

pytestmark = pytest.mark.torch


class TestTorchConformance(BackendConformance):
    backend = "torch"


class TestTorchFaults(FaultConformance):
    backend = "torch"
    processes = 2
    restart_faults = ("kill", "hang")  # a stall under the elastic agent: crosstrain's watcher
