"""What a backend speaks, and the check of a plan against it before anything starts.

Core owns the names (layer types, losses, optimizers, precisions, the metrics a backend
counts, the weight-decay modes); a backend maps each
name it supports to its own builder in tables and declares the names through the optional
:class:`SpeaksVocabulary` capability. A plan that uses a name outside the chosen
backend's tables is refused with one :class:`PlanError` naming the field
(``model.blocks.decoder.layers[1]: the jax backend has no 'attention'``) before the output
folder exists or any process starts, never by a fallback at step 1.

``train.shard`` is checked apart (:func:`check_shard_mode`), by admission only: a sharded
run's checkpoint is neutral, so evaluating or predicting with it on a backend that cannot
train sharded is fine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import attrs

from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import iter_layers
from crosstrain.core.model.layers import LAYER_TYPES
from crosstrain.core.model.optimizers import DECAY_MODES, OPTIMIZERS
from crosstrain.core.spec.plan import COUNTED_METRICS, LOSSES, PRECISIONS, SHARD_MODES, Plan

#: layer types that are structure, not computation: resolved by core's graph, no builder
STRUCTURAL_LAYERS = frozenset({"block"})


@attrs.frozen
class Vocabulary:
    """The names a backend can build, one set per closed set of the plan. ``metrics``: the
    metrics its eval step counts (:data:`crosstrain.core.spec.plan.COUNTED_METRICS`; core derives
    the loss and perplexity itself); ``decay``: the ``optimizer.decay`` modes its optimizer
    honours; ``shard``: the ``train.shard`` modes it trains, and ``unsharded``, why it has
    no other mode, mode by mode, for the refusal's line ((mode, reason) pairs; a mode left
    out is "not implemented"). A backend that does not name them speaks accuracy, decays
    every weight and replicates (shard "none")."""

    layers: frozenset[str]
    losses: frozenset[str]
    optimizers: frozenset[str]
    precisions: frozenset[str]
    metrics: frozenset[str] = frozenset({"accuracy"})
    decay: frozenset[str] = frozenset({"all"})
    shard: frozenset[str] = frozenset({"none"})
    unsharded: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls,
        layers: Iterable[str],
        losses: Iterable[str],
        optimizers: Iterable[str],
        precisions: Iterable[str],
        metrics: Iterable[str] = ("accuracy",),
        decay: Iterable[str] = ("all",),
        shard: Iterable[str] = ("none",),
        unsharded: Iterable[tuple[str, str]] = (),
    ) -> Vocabulary:
        return cls(
            frozenset(layers),
            frozenset(losses),
            frozenset(optimizers),
            frozenset(precisions),
            frozenset(metrics),
            frozenset(decay),
            frozenset(shard),
            tuple(sorted(unsharded)),
        )


#: every name core defines: a backend whose tables cover this is complete. Of the shard
#: modes, "none" alone: sharding is optional (a complete backend may replicate only;
#: :data:`crosstrain.core.spec.plan.SHARD_MODES` has them all)
CORE_VOCABULARY = Vocabulary.of(
    set(LAYER_TYPES) - STRUCTURAL_LAYERS, LOSSES, OPTIMIZERS, PRECISIONS, COUNTED_METRICS, DECAY_MODES
)
#: why a mode a backend does not declare is refused, when the backend does not say
NOT_IMPLEMENTED = "not implemented on this backend yet"


@runtime_checkable
class SpeaksVocabulary(Protocol):
    """Optional capability: the names this backend's tables build."""

    @classmethod
    def vocabulary(cls) -> Vocabulary:
        """The backend's tables' keys; must not start the framework's runtime."""
        ...


def missing_names(vocabulary: Vocabulary) -> dict[str, list[str]]:
    """Core names a backend lacks, per set: empty for a complete backend (shard modes
    beyond "none" are optional, and not among them)."""
    gaps = {
        "layers": CORE_VOCABULARY.layers - vocabulary.layers,
        "losses": CORE_VOCABULARY.losses - vocabulary.losses,
        "optimizers": CORE_VOCABULARY.optimizers - vocabulary.optimizers,
        "precisions": CORE_VOCABULARY.precisions - vocabulary.precisions,
        "metrics": CORE_VOCABULARY.metrics - vocabulary.metrics,
        "decay": CORE_VOCABULARY.decay - vocabulary.decay,
    }
    return {kind: sorted(names) for kind, names in gaps.items() if names}


def check_plan_vocabulary(plan: Plan, vocabulary: Vocabulary, backend: str) -> None:
    """Refuse the first name in ``plan`` that ``backend`` cannot build, naming its field."""

    def refuse(field: str, name: str, kind: str) -> PlanError:
        return PlanError(f"the {backend} backend has no {kind}{name!r}", field=field, source=plan.source)

    if plan.model.native is None:
        blocks = {name: spec.layers for name, spec in plan.model.blocks.items()}
        for field, layer in iter_layers(plan.model.layers, blocks):
            if layer.type not in STRUCTURAL_LAYERS and layer.type not in vocabulary.layers:
                raise refuse(field, layer.type, "")
    if plan.loss.name not in vocabulary.losses:
        raise refuse("loss.name", plan.loss.name, "loss ")
    if plan.optimizer.name not in vocabulary.optimizers:
        raise refuse("optimizer.name", plan.optimizer.name, "optimizer ")
    if plan.train.precision not in vocabulary.precisions:
        raise refuse("train.precision", plan.train.precision, "precision ")
    for metric in plan.metrics:
        if metric in COUNTED_METRICS and metric not in vocabulary.metrics:
            raise refuse("metrics", metric, "metric ")
    if plan.optimizer.decay not in vocabulary.decay:
        raise refuse("optimizer.decay", plan.optimizer.decay, "decay mode ")


def check_shard_mode(plan: Plan, vocabulary: Vocabulary | None, backend: str) -> None:
    """Refuse a ``train.shard`` mode the backend does not declare, with its reason
    (``vocabulary`` None: a backend that declares no vocabulary, which replicates only)."""
    mode = plan.train.shard
    declared = vocabulary.shard if vocabulary is not None else frozenset({"none"})
    if mode in declared:
        return
    reasons = dict(vocabulary.unsharded) if vocabulary is not None else {}
    if vocabulary is None:
        reason = "it declares no shard modes (no vocabulary()), so it only replicates"
    else:
        reason = reasons.get(mode, NOT_IMPLEMENTED)
    modes = ", ".join(repr(name) for name in SHARD_MODES if name in declared)
    raise PlanError(
        f"the {backend} backend has no shard mode {mode!r}: {reason} (it trains with {modes})",
        field="train.shard",
        source=plan.source,
    )
