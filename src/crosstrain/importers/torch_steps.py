"""One fx node as the torch importer reads it (:class:`Step`), what a node gives as the plan
sees it (:class:`Value`), the refusal (:class:`ImportRefused`) and the :class:`Converter`
record of the table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from torch import fx, nn

from crosstrain.core.errors import InputError
from crosstrain.importers.common import Conversion


class Batch(enum.Enum):
    """What ``x.size(0)`` gives: the batch, known only at run time (a view may read it)."""

    SIZE = "x.size(0)"


BATCH = Batch.SIZE


class ImportRefused(InputError):
    """An fx node (or an option of one) that no plan layer computes."""


@attrs.frozen(eq=False)
class Value:
    """What an fx node gives, as the plan sees it: the plan layer that makes it, its torch
    shape (batch axis included) and, for an image's flattened features, ``order``: plan
    feature i is torch feature ``order[i]``. ``is_pair`` marks MultiheadAttention's
    (output, weights) pair, of which only item 0 is read."""

    source: str
    shape: tuple[int, ...]
    order: np.ndarray | None = None
    is_pair: bool = False

    @property
    def image(self) -> bool:
        return len(self.shape) == 4

    def plan_axis(self, dim: int) -> int:
        """A torch ``dim`` (batch axis 0, negative from the end) as the plan's row axis."""
        rank = len(self.shape)
        dim = dim + rank if dim < 0 else dim
        if dim == 0:
            raise ValueError("the batch axis")
        if self.image:
            return {1: 2, 2: 0, 3: 1}[dim]
        return dim - 1


@attrs.frozen
class Step:
    """One fx node to convert: the node, its live module (``call_module``), the values among
    its arguments in order, its other arguments and keyword arguments."""

    node: fx.Node
    module: nn.Module | None
    arguments: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    shape: tuple[int, ...]  # the node's torch output shape (batch axis included)

    @property
    def inputs(self) -> tuple[Value, ...]:
        """The values among the positional arguments, in order (``torch.cat``'s list opened)."""
        return tuple(argument for argument in _flat(self.arguments) if isinstance(argument, Value))

    @property
    def constants(self) -> tuple[Any, ...]:
        return tuple(argument for argument in self.arguments if not isinstance(argument, Value))

    @property
    def shown(self) -> str:
        if self.module is not None:
            return type(self.module).__name__
        target = self.node.target
        if isinstance(target, str):
            return f"Tensor.{target}"
        module = (getattr(target, "__module__", "") or "").removeprefix("_")  # _operator: operator
        return f"{module}.{getattr(target, '__name__', target)}".lstrip(".")

    def refuse(self, problem: str) -> ImportRefused:
        return ImportRefused(f"fx node {self.node.name!r} ({self.shown}): {problem}")

    def argument(self, index: int, key: str, default: Any) -> Any:
        """A call's argument by position (among all its arguments) or keyword."""
        if key in self.kwargs:
            return self.kwargs[key]
        return self.arguments[index] if index < len(self.arguments) else default

    def option(self, key: str, value: Any, expected: Any, why: str) -> None:
        """Refuse unless ``value`` (the module's ``key``) is ``expected`` (one or a tuple)."""
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if value not in allowed:
            raise self.refuse(f"{key}={value!r}: {why}")

    def plan_axis(self, dim: int) -> int:
        try:
            return self.inputs[0].plan_axis(dim)
        except ValueError:
            raise self.refuse(
                f"dim={dim}: the plan's layers act within a row, not across the batch"
            ) from None


@attrs.frozen
class Converter:
    """How one module class, function or method becomes plan layers, and what it does with
    an image's features flattened in torch's order (refused unless one of these says):
    ``carries_order`` (elementwise: its output keeps the order), ``reads_order`` (takes the
    order into its weights: a Linear)."""

    convert: Callable[[Step], Conversion]
    carries_order: bool = False
    reads_order: Callable[[Step, np.ndarray], Conversion] | None = None
    #: it flattens: its output's features are in torch's order (:func:`_flatten_order`)
    flattens: bool = False
    #: it gives sizes, not a tensor (``x.size(0)``): its value is what this returns
    sizes: Callable[[Step], Any] | None = None


def _flat(arguments: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for argument in arguments:
        flat.extend(_flat(argument) if isinstance(argument, list | tuple) else [argument])
    return flat
