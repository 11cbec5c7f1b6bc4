"""TorchStrategy in one process (world 1, no DDP): the protocol's weight exchange."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.backends.torch.strategy import TorchStrategy
from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.planfile import load_plan

pytestmark = pytest.mark.torch


def test_state_dict_is_a_snapshot_and_round_trips(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan())
    strategy = TorchStrategy()
    weights = initial_weights(plan)
    state = strategy.build(plan, weights)
    before = strategy.state_dict(state)
    assert all(np.array_equal(before[name], value) for name, value in weights.items())

    train = load_datasets(plan).train
    rows = slice(0, plan.train.global_batch_size)
    batch = Batch(train.x[rows], train.y[rows], np.ones(plan.train.global_batch_size, np.float32))
    strategy.train_step(state, StepBatch((batch,), global_real_rows=plan.train.global_batch_size), lr=0.1)

    # the earlier snapshot did not move with the parameters (biases included)
    assert all(np.array_equal(before[name], value) for name, value in weights.items())
    after = strategy.state_dict(state)
    assert not np.array_equal(after["dense_0.bias"], before["dense_0.bias"])
    strategy.load_state_dict(state, before)
    assert all(np.array_equal(strategy.state_dict(state)[name], value) for name, value in before.items())
