"""Every hook crosstrain calls, grouped by phase.

Implement a hook with ``@crosstrain.hookimpl`` in a module named by an entry point
of the ``crosstrain`` group. Lifecycle hooks run on **every** process, with
``context.world.is_main`` at hand: work meant for rank 0 only (writing files,
printing) is the plugin's own choice, and a hook must never start a collective
operation, since other ranks might not.

A hook ends training normally with ``context.request_stop(reason)`` (on one rank or
all): the ranks agree at the next read of the step losses or the epoch's end and stop
before the same step; the summary's ``stopped`` says why.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from crosstrain.core.run.context import RunContext
    from crosstrain.core.run.strategy import DistributedStrategy

hookspec = pluggy.HookspecMarker("crosstrain")
hookimpl = pluggy.HookimplMarker("crosstrain")


# --------------------------------------------------------------------------- registration


@hookspec
def crosstrain_backends() -> list[type[DistributedStrategy]]:  # type: ignore[empty-body]
    """Return the backend classes this plugin provides.

    Each class implements :class:`crosstrain.core.run.strategy.DistributedStrategy` and is
    selected by its ``name`` (``--backend NAME``). The module holding this hook must
    import without the backend's framework, so that ``crosstrain backends`` can say the
    framework is missing instead of failing. Two distributions returning the same
    ``name`` is an error that names both.
    """


@hookspec
def crosstrain_addoption(parser: argparse.ArgumentParser) -> None:
    """Add command-line options to ``crosstrain run`` (and ``compare``).

    Called once in the CLI process, before arguments are parsed. Add options to an
    argument group of your own; parsed values reach every hook as
    ``context.options[dest]``.
    """


# --------------------------------------------------------------------------- run lifecycle


@hookspec
def crosstrain_train_start(context: RunContext) -> None:
    """Called on every process once the model is built, before the first step."""


@hookspec
def crosstrain_step_end(
    context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
) -> None:
    """Called on every process after each optimizer step.

    ``step`` counts optimizer steps from 1; ``epoch`` counts from 0; ``lr`` is the rate
    the step used; ``metrics`` are global (identical on every rank), at least ``loss``.
    """


@hookspec
def crosstrain_eval_end(context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
    """Called on every process after each evaluation with the exact global eval metrics
    (``loss``, ``accuracy`` where the plan asks for it, ``count``)."""


@hookspec
def crosstrain_epoch_end(context: RunContext, epoch: int, metrics: Mapping[str, float]) -> None:
    """Called on every process at the end of each epoch. ``metrics`` holds the epoch's mean
    train ``loss``, ``samples_per_second``, and ``eval_*`` values when it evaluated."""


@hookspec
def crosstrain_checkpoint_saved(context: RunContext, path: str, step: int) -> None:
    """Called on every process after rank 0 wrote a checkpoint at ``path``."""


@hookspec
def crosstrain_train_end(context: RunContext, summary: Mapping[str, Any]) -> None:
    """Called on every process after training with the run's summary (see summary.json)."""


# --------------------------------------------------------------------------- failure


@hookspec
def crosstrain_exception(context: RunContext, rank: int, error: BaseException) -> None:
    """Called once on a process whose training raised, with its ``rank`` and ``error``.

    The rank that failed first reports the original error. A peer whose collective then
    breaks (before the launcher stops it) may report its own, secondary, error once too.
    Files written so far must be kept: flush and close, never truncate.
    """
