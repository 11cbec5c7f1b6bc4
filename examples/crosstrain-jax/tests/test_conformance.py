"""crosstrain's conformance suite (crosstrain.testing), run on this third-party backend as on
the built-in ones, and its agreement with the torch reference."""

from __future__ import annotations

from crosstrain.testing.agreement import AgreesWithTorch
from crosstrain.testing.conformance import BackendConformance
from crosstrain.testing.fault_matrix import FaultConformance


class TestJaxConformance(BackendConformance):
    backend = "jax"


class TestJaxAgreesWithTorch(AgreesWithTorch):
    backend = "jax"


class TestJaxFaults(FaultConformance):
    """A rank killed or hung. The launcher is crosstrain's own supervisor, whose signals and
    restarts crosstrain's suite checks under tf --workers 2 (the same launcher code), and
    BackendConformance restarts this backend's group once."""

    backend = "jax"
    launcher_signals = ()
    restart_faults = ()
