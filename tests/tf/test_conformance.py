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
    """One process holding both replicas (MirroredStrategy): the process is rank 0. (A
    killed worker is the same path as below; BackendConformance raises in it.)"""

    backend = "tf"
    rank_faults = ("hang",)
    restart_faults = ()  # restarting this one process: BackendConformance's restart check


class TestTfWorkersFaults(FaultConformance):
    """Two worker processes (MultiWorkerMirroredStrategy)."""

    backend = "tf"
    layout = ("--workers", "2")
    processes = 2
    rank_faults = ("raise", "kill", "hang")
    launcher_signals = ("SIGKILL",)  # SIGINT and SIGTERM: the same launcher code as above
