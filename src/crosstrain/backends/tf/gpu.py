"""What a tf worker knows of its GPUs: NVML's free memory of the first (for
``data.placement = "auto"``) and how busy it is, and TensorFlow's allocator's peak (both for
summary.json's ``ranks``, as the torch backend reports them). NVML needs ``pynvml``; without
it, or where NVML cannot say, the value is unknown (None) and nothing fails.

This module imports tensorflow and pynvml only inside functions.
"""

from __future__ import annotations

import os
from typing import Any

from crosstrain.core.run.rank_usage import GpuUtilisation


def nvml_name(ordinal: int, visible: str | None) -> str:
    """NVML's name (an index or a UUID) of CUDA device ``ordinal`` in a process whose
    ``CUDA_VISIBLE_DEVICES`` is ``visible`` (None: every GPU, in NVML's order)."""
    return visible.split(",")[ordinal].strip() if visible else str(ordinal)


def first_gpu_handle() -> Any | None:
    """NVML's handle of the first GPU this worker was given (``worker.configure_devices``),
    NVML initialised; None without ``pynvml`` or when NVML cannot say."""
    import tensorflow as tf

    try:
        import pynvml
    except ImportError:
        return None
    ordinal = int(tf.config.get_visible_devices("GPU")[0].name.rsplit(":", 1)[1])
    name = nvml_name(ordinal, os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        pynvml.nvmlInit()
        if name.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(name))
        return pynvml.nvmlDeviceGetHandleByUUID(name)
    except pynvml.NVMLError:
        return None


def free_gpu_bytes() -> int | None:
    """Free memory of the first GPU ("auto" keeps the data on the host when None)."""
    handle = first_gpu_handle()
    if handle is None:
        return None
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except pynvml.NVMLError:
        return None


def sample_utilisation() -> GpuUtilisation:
    """The first GPU's utilisation, sampled from now on (nothing is sampled without NVML)."""
    handle = first_gpu_handle()

    def read() -> float:
        if handle is None:
            raise RuntimeError("NVML cannot say")
        import pynvml

        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    return GpuUtilisation(read).start()


def _local_gpus() -> list[str]:
    import tensorflow as tf

    return [f"GPU:{index}" for index in range(len(tf.config.list_logical_devices("GPU")))]


def reset_peak_memory() -> None:
    """Start counting the peak of this process's GPUs from here."""
    import tensorflow as tf

    for device in _local_gpus():
        tf.config.experimental.reset_memory_stats(device)


def peak_memory_bytes() -> float | None:
    """The largest peak of this process's GPUs since :func:`reset_peak_memory`, as
    TensorFlow's allocator counts it (None: no GPU)."""
    import tensorflow as tf

    peaks = [tf.config.experimental.get_memory_info(device)["peak"] for device in _local_gpus()]
    return float(max(peaks)) if peaks else None
