"""What a tf worker reports of its GPUs. No GPU here: NVML's naming of the worker's GPU, and
that a CPU worker reports no device (the GPU side ran nowhere yet: the lent GPU machine has
no TensorFlow)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.backends.tf.gpu import nvml_name
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.planfile import load_plan

pytestmark = pytest.mark.tf


def test_nvml_names_the_gpu_cuda_visible_devices_maps_the_ordinal_to() -> None:
    assert [nvml_name(ordinal, None) for ordinal in (0, 1)] == ["0", "1"]
    assert nvml_name(1, "4, 6") == "6"
    uuid = "GPU-8d0c3a2e-1f4b-4c8e-9a7d-0b5e6f7a8b9c"
    assert nvml_name(0, f"{uuid},GPU-other") == uuid


def test_a_cpu_worker_reports_no_device(write_plan: Callable[..., Path]) -> None:
    pytest.importorskip("tensorflow")
    from crosstrain.backends.tf.strategy import TfStrategy

    plan = load_plan(write_plan())
    strategy = TfStrategy.local("cpu")
    state = strategy.build(plan, initial_weights(plan))
    assert strategy.device_report(state) == {} and state.utilisation is None
