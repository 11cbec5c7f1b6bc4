"""Every layer type of core's vocabulary: forward and gradients on tf equal torch's, from the
same numpy weights and inputs, in training mode (batch norm on a row mask, dropout at a
step). The cases live in crosstrain.testing.layer_cases, shared with every backend."""

from __future__ import annotations

import numpy as np
import pytest

from crosstrain.core.model.layers import Dropout
from crosstrain.core.spec.plan import Plan
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

pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.cross


def test_every_core_layer_type_has_a_case() -> None:
    assert missing_cases() == []


def _tf_results(plan: Plan) -> CaseResults:
    from crosstrain.backends.tf.model import build_model, load_neutral, neutral_state

    inputs = case_inputs(plan)
    model = build_model(plan)
    load_neutral(model, plan, case_weights(plan))
    x = tf.constant(inputs["x"])
    variables = model.neutral_variables()
    with tf.GradientTape(persistent=True) as tape:
        if x.dtype.is_floating:
            tape.watch(x)
        outputs = model(x, training=True, weight=inputs["weight"], rows=inputs["rows"], step=np.int64(STEP))
        total = tf.reduce_sum(outputs * inputs["upstream"])
    gradients = {
        name: tf.convert_to_tensor(tape.gradient(total, variables[name])).numpy()
        for name in trainable_names(plan)
    }
    input_gradient = tape.gradient(total, x).numpy() if x.dtype.is_floating else None
    return CaseResults(outputs.numpy(), input_gradient, gradients, neutral_state(model, plan))


@pytest.mark.parametrize("kind", PARITY_CASES, ids=case_id)
def test_forward_and_gradients_agree(kind: str) -> None:
    plan = case_plan(kind)
    expected = torch_results(plan)
    assert_same_results(_tf_results(plan), expected)
    if kind == Dropout.type:  # the masks really drop something: the same somethings
        assert 0.1 < np.mean(expected.outputs == 0) < 0.5
