"""The conformance suite every backend runs (crosstrain.testing), on tf."""

from __future__ import annotations

import pytest

from crosstrain.testing.conformance import BackendConformance
from crosstrain.testing.fault_matrix import FaultConformance

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


class TestTfConformance(BackendConformance):
    backend = "tf"


class TestTfFaults(FaultConformance):
    """One process holding both replicas (MirroredStrategy): the process is rank 0. Its
    launcher is crosstrain's own supervisor, whose whole matrix runs below under --workers 2:
    here only the stall of the one process. (A killed worker is the same path as below;
    BackendConformance raises in it and restarts it.)"""

    backend = "tf"
    rank_faults = ("hang",)
    launcher_signals = ()
    restart_faults = ()


class TestTfWorkersFaults(FaultConformance):
    """Two worker processes (MultiWorkerMirroredStrategy): the whole fault matrix of
    crosstrain's own supervisor (``crosstrain.launch``), which every subprocess backend shares."""

    backend = "tf"
    layout = ("--workers", "2")
    processes = 2
    rank_faults = ("raise", "kill", "hang")
