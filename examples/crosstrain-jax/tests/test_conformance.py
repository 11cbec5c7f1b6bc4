"""crosstrain's conformance suite (crosstrain.testing), run on this third-party backend as on
the built-in ones, and its agreement with the torch reference."""

from __future__ import annotations

import pytest
from crosstrain.testing.conformance import AgreesWithTorch, BackendConformance
from crosstrain.testing.fault_matrix import FaultConformance

# the suite's checks and the comparison with torch read the same session runs: under
# pytest-xdist (-n 2 --dist loadgroup) they run in one worker, which makes each run once
RUNS = pytest.mark.xdist_group("runs-jax")


@RUNS
class TestJaxConformance(BackendConformance):
    backend = "jax"


@RUNS
class TestJaxAgreesWithTorch(AgreesWithTorch):
    backend = "jax"


class TestJaxFaults(FaultConformance):
    """A rank killed or hung. The launcher is crosstrain's own supervisor, whose signals and
    restarts crosstrain's suite checks under tf --workers 2 (the same launcher code), and
    BackendConformance restarts this backend's group once."""

    backend = "jax"
    launcher_signals = ()
    restart_faults = ()
