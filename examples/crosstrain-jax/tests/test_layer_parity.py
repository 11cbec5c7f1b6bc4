"""Every layer type of core's vocabulary: forward and gradients on jax equal torch's, from the
same numpy weights and inputs, in training mode (batch norm on a row mask, dropout at a
step). The cases live in crosstrain.testing.layer_cases, shared with every backend (tests/
cross/test_layer_parity.py runs them for tf)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from crosstrain import Dropout, Plan, dropout
from crosstrain.testing.layer_cases import (
    PARITY_CASES,
    STEP,
    CaseResults,
    assert_same_results,
    case_id,
    case_inputs,
    case_plan,
    case_weights,
    missing_cases,
    torch_results,
    trainable_names,
)

from crosstrain_jax.model import build_forward
from crosstrain_jax.nodes import Params, TrainInputs

pytestmark = pytest.mark.torch


def test_every_core_layer_type_has_a_case() -> None:
    assert missing_cases() == []


def _uint32(values: np.ndarray | int) -> np.ndarray:
    """Steps and row positions as the strategy hands them to the compiled step."""
    return (np.asarray(values, np.int64) & dropout.MASK32).astype(np.uint32)


def _jax_results(plan: Plan) -> CaseResults:
    inputs = case_inputs(plan)
    weights = {name: jnp.asarray(value, jnp.float32) for name, value in case_weights(plan).items()}
    trainable = trainable_names(plan)
    # split as the strategy does: what the gradient sees, and the rest (moving statistics)
    params = {name: weights[name] for name in trainable}
    buffers = {name: value for name, value in weights.items() if name not in params}
    forward = build_forward(plan)
    train = TrainInputs(jnp.asarray(_uint32(STEP)), jnp.asarray(_uint32(inputs["rows"])),
                        jnp.asarray(inputs["weight"], jnp.float32))
    x = jnp.asarray(inputs["x"])
    float_input = jnp.issubdtype(x.dtype, jnp.floating)

    def total(
        params: Params, x: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
        outputs, updates = forward({**params, **buffers}, x, train)
        return jnp.sum(outputs * inputs["upstream"]), (outputs, updates)

    argnums = (0, 1) if float_input else (0,)
    gradients, (outputs, updates) = jax.jit(
        jax.grad(total, argnums=argnums, has_aux=True))(params, x)
    input_gradient = np.asarray(gradients[1]) if float_input else None
    after = {name: np.asarray(value) for name, value in {**weights, **updates}.items()}
    return CaseResults(
        np.asarray(outputs), input_gradient,
        {name: np.asarray(value) for name, value in gradients[0].items()}, after,
    )


@pytest.mark.parametrize("kind", PARITY_CASES, ids=case_id)
def test_forward_and_gradients_agree(kind: str) -> None:
    pytest.importorskip("torch")
    plan = case_plan(kind)
    expected = torch_results(plan)
    assert_same_results(_jax_results(plan), expected)
    if kind == Dropout.type:  # the masks really drop something: the same somethings
        assert 0.1 < np.mean(expected.outputs == 0) < 0.5
