"""The neutral optimizer vocabulary: each optimizer's name and the slots it keeps.

A plan's ``optimizer.name`` is one of :data:`OPTIMIZERS`; what its hyperparameters mean is
:class:`crosstrain.core.plan.OptimizerSpec`'s (torch's semantics). A checkpoint holds each
trainable weight's slots as ``optimizer.{weight}.{slot}`` under the names of
:data:`OPTIMIZER_SLOTS`, the same on every backend, so a run saved on one resumes on another.

A new optimizer is its name and slots here plus one row in each backend's ``OPTIMIZERS``
table; a backend without the row is refused by the plan check (its vocabulary is the table's
keys), and ``tests/core/test_vocabulary.py`` keeps the two names below in step.
"""

from __future__ import annotations

import typing
from typing import Literal

OptimizerName = Literal["sgd", "adam", "adamw"]
OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)

#: core optimizer name -> its slot names, in the order the backends keep them (sgd keeps
#: its momentum buffer only when ``momentum`` > 0)
OPTIMIZER_SLOTS: dict[OptimizerName, tuple[str, ...]] = {
    "sgd": ("momentum",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
}
