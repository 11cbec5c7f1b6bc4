"""The optimizer of the tf backend, written in TensorFlow ops to mean what a plan means.

Keras's SGD keeps the learning rate inside the momentum buffer, its Adam places epsilon
differently and its weight decay is always decoupled, while a plan means torch's
semantics (see OptimizerSpec). The per-step scalars (bias corrections, decay factor)
are computed on the host in float64 exactly as torch computes them; fp16 uses
torch.amp.GradScaler's dynamic loss scale, and clipping torch's global-norm rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from crosstrain.core.spec.plan import OptimizerSpec

# Positions in the vector of per-step scalars handed to the compiled step (in the weights'
# dtype: float32, or float64 under fp64).
LR, STEP_SIZE, BIAS2_SQRT, DECAY, LOSS_SCALE, REAL_TARGETS = range(6)
SCALAR_COUNT = REAL_TARGETS + 1

UpdateRule = Callable[[Any, Any, Sequence[Any], Any], tuple[Any, tuple[Any, ...]]]


@attrs.define
class DynamicLossScale:
    """torch.amp.GradScaler's rule, kept on the host: halve on inf/nan (and skip the
    step), double after ``growth_interval`` finite steps in a row."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    finite_steps: int = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= 0.5
            self.finite_steps = 0
            return
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.scale *= 2.0
            self.finite_steps = 0


def clip_like_torch(grads: list[Any], max_norm: float) -> list[Any]:
    """torch.nn.utils.clip_grad_norm_: the norm of per-tensor norms, coefficient
    max_norm / (norm + 1e-6) capped at 1, always multiplied in."""
    import tensorflow as tf

    norm = tf.norm(tf.stack([tf.norm(g) for g in grads]))
    coefficient = tf.minimum(max_norm / (norm + 1e-6), 1.0)
    return [g * coefficient for g in grads]


def step_scalars(
    spec: OptimizerSpec,
    lr: float,
    step: int,
    loss_scale: float,
    real_targets: int,
    dtype: str = "float32",
) -> np.ndarray:
    """The per-step scalars in float64, as torch computes them, handed over in ``dtype``,
    the weights' (torch casts a Python scalar to the tensor's dtype): float32, or float64
    under fp64.

    ``step`` counts from 1 (torch increments Adam's step before using it);
    ``real_targets`` is the step's loss normaliser (``StepBatch.global_real_targets``)."""
    step_size, bias2_sqrt, decay = OPTIMIZERS[spec.name].corrections(spec, lr, step)
    return np.array([lr, step_size, bias2_sqrt, decay, loss_scale, real_targets], dtype)


def update_rule(spec: OptimizerSpec, decays: bool = True) -> UpdateRule:
    """(variable, grad, slots, scalars) -> (new value, new slots), torch's update order;
    ``decays``: whether ``weight_decay`` applies to this variable (``optimizer.decay``)."""
    return OPTIMIZERS[spec.name].rule(spec if decays else attrs.evolve(spec, weight_decay=0.0))


def slot_count(spec: OptimizerSpec) -> int:
    """Slots per trainable variable (momentum buffer; Adam's two moments)."""
    return OPTIMIZERS[spec.name].slots(spec)


def make_slots(spec: OptimizerSpec, variables: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Zeroed slots for each of ``variables``, which must be the trainable ones: batch
    norm's moving statistics are updated by the forward pass, never by an optimizer.
    Call it under the distribution's scope so the slots are mirrored like the variables."""
    import tensorflow as tf

    untrainable = [v.name for v in variables if not v.trainable]
    if untrainable:
        raise ValueError(f"no optimizer slots for non-trainable variables {untrainable}")
    count = slot_count(spec)
    return [
        tuple(tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for _ in range(count))
        for v in variables
    ]


def _no_corrections(spec: OptimizerSpec, lr: float, step: int) -> tuple[float, float, float]:
    return 1.0, 1.0, 1.0


def _adam_corrections(spec: OptimizerSpec, lr: float, step: int) -> tuple[float, float, float]:
    """(step size with the first bias correction, sqrt of the second, no decay factor)."""
    return lr / (1 - spec.beta1**step), (1 - spec.beta2**step) ** 0.5, 1.0


def _adamw_corrections(spec: OptimizerSpec, lr: float, step: int) -> tuple[float, float, float]:
    """Adam's corrections and AdamW's decoupled decay factor ``1 - lr * weight_decay``."""
    step_size, bias2_sqrt, _ = _adam_corrections(spec, lr, step)
    return step_size, bias2_sqrt, 1 - lr * spec.weight_decay


def _sgd_rule(spec: OptimizerSpec) -> UpdateRule:
    def rule(variable: Any, grad: Any, slots: Sequence[Any], scalars: Any) -> tuple[Any, tuple[Any, ...]]:
        if spec.weight_decay:
            grad = grad + spec.weight_decay * variable  # L2 on the gradient
        if not spec.momentum:
            return variable - scalars[LR] * grad, ()
        buffer = slots[0] * spec.momentum + grad  # lr stays outside the buffer
        direction = grad + spec.momentum * buffer if spec.nesterov else buffer
        return variable - scalars[LR] * direction, (buffer,)

    return rule


def _adam_rule(spec: OptimizerSpec, decoupled: bool = False) -> UpdateRule:
    """Adam; ``decoupled``: AdamW, whose decay scales the weights instead of the gradient."""
    import tensorflow as tf

    def rule(variable: Any, grad: Any, slots: Sequence[Any], scalars: Any) -> tuple[Any, tuple[Any, ...]]:
        mean, square = slots
        if decoupled and spec.weight_decay:
            variable = variable * scalars[DECAY]
        elif spec.weight_decay:
            grad = grad + spec.weight_decay * variable
        mean = mean + (1 - spec.beta1) * (grad - mean)  # torch's lerp
        square = square * spec.beta2 + (1 - spec.beta2) * grad * grad
        denominator = tf.sqrt(square) / scalars[BIAS2_SQRT] + spec.eps
        return variable - scalars[STEP_SIZE] * (mean / denominator), (mean, square)

    return rule


@attrs.frozen
class OptimizerKind:
    """How one core optimizer runs here: its slots, its host-side scalars, its update."""

    slots: Callable[[OptimizerSpec], int]
    corrections: Callable[[OptimizerSpec, float, int], tuple[float, float, float]]
    rule: Callable[[OptimizerSpec], UpdateRule]


#: core optimizer name -> how it runs; a name missing here is refused before launch
OPTIMIZERS: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind(
        slots=lambda spec: 1 if spec.momentum else 0, corrections=_no_corrections, rule=_sgd_rule
    ),
    "adam": OptimizerKind(slots=lambda spec: 2, corrections=_adam_corrections, rule=_adam_rule),
    "adamw": OptimizerKind(
        slots=lambda spec: 2,
        corrections=_adamw_corrections,
        rule=lambda spec: _adam_rule(spec, decoupled=True),
    ),
}
