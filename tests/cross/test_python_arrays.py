"""crosstrain.fit's arrays from every framework: a tf tensor, a jax array and a torch tensor
each reach the host as the numpy array they hold (CUDA tensors and CuPy: tests/torch/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from crosstrain.core.admission.python_arrays import host_array

pytestmark = pytest.mark.cross


def test_tf_jax_and_torch_arrays_reach_the_host_as_they_are() -> None:
    import jax.numpy as jnp
    import tensorflow as tf
    import torch

    rows = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    labels = np.arange(5, dtype=np.int32)  # jax keeps 32-bit integers unless told otherwise
    for make in (tf.constant, jnp.asarray, torch.from_numpy):
        for array in (rows, labels):
            held = host_array(make(array), "x")
            assert held.dtype == array.dtype and np.array_equal(held, array), make
