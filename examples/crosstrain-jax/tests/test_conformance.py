"""crosstrain's conformance suite (crosstrain.testing), run on this third-party backend as on
the built-in ones, and its agreement with the torch reference."""

from __future__ import annotations

from crosstrain.testing.conformance import AgreesWithTorch, BackendConformance
from crosstrain.testing.fault_matrix import FaultConformance


class TestJaxConformance(BackendConformance):
    backend = "jax"


class TestJaxAgreesWithTorch(AgreesWithTorch):
    backend = "jax"


class TestJaxFaults(FaultConformance):
    backend = "jax"
