"""The neutral optimizer vocabulary: each optimizer's name and the slots it keeps.

A plan's ``optimizer.name`` is one of :data:`OPTIMIZERS`; what its hyperparameters mean is
:class:`crosstrain.core.spec.plan.OptimizerSpec`'s (torch's semantics). A checkpoint holds each
trainable weight's slots as ``optimizer.{weight}.{slot}`` under the names of
:data:`OPTIMIZER_SLOTS`, the same on every backend, so a run saved on one resumes on another.

A new optimizer is its name and slots here plus one row in each backend's ``OPTIMIZERS``
table; a backend without the row is refused by the plan check (its vocabulary is the table's
keys), and ``tests/core/spec/test_vocabulary.py`` keeps the two names below in step.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Literal

from crosstrain.core.model.layers import WeightSpec

OptimizerName = Literal["sgd", "adam", "adamw"]
OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)

#: core optimizer name -> its slot names, in the order the backends keep them (sgd keeps
#: its momentum buffer only when ``momentum`` > 0)
OPTIMIZER_SLOTS: dict[OptimizerName, tuple[str, ...]] = {
    "sgd": ("momentum",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
}

#: ``optimizer.decay``: which trainable weights ``weight_decay`` applies to. "all": every
#: one (torch.optim's default); "kernels": the matrix and convolution kernels only, no decay
#: on biases, norm scales and offsets, embedding and position tables (as GPT-2 and minGPT
#: train; a tied output dense uses its embedding's table, so it is not decayed either)
DecayName = Literal["all", "kernels"]
DECAY_MODES: tuple[str, ...] = typing.get_args(DecayName)
DECAY: dict[str, Callable[[WeightSpec], bool]] = {
    "all": lambda spec: True,
    "kernels": lambda spec: spec.kernel,
}


def decayed_weights(specs: Mapping[str, WeightSpec], decay: str) -> frozenset[str]:
    """The neutral names of the trainable weights that weight decay applies to under
    ``decay`` (a name of :data:`DECAY`): what every backend's optimizer decays."""
    chooses = DECAY[decay]
    return frozenset(name for name, spec in specs.items() if spec.trainable and chooses(spec))
