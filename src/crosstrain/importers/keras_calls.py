"""One call of a Keras layer or op as the Keras importer reads it (:class:`Call`), the
refusal it raises (:class:`ImportRefused`) and the :class:`Converter` record of the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from crosstrain.core.errors import InputError
from crosstrain.core.model.layers import (
    Shape,
)
from crosstrain.importers.common import Conversion


class ImportRefused(InputError):
    """A Keras layer (or an option of one) that no plan layer computes."""


@attrs.frozen
class TensorRef:
    """A Keras tensor an argument names: the layer that made it and its per-row shape."""

    source: str
    shape: Shape


@attrs.frozen
class Call:
    """One call of a Keras layer or op in the model, as the model's config records it:
    ``inputs`` are the tensors among its positional arguments (in order, lists flattened),
    ``constants`` the other positional arguments (an op's ``3.0``)."""

    name: str
    class_name: str
    config: Mapping[str, Any]
    operation: Any  # the live keras Layer (or Operation), for its weights
    arguments: tuple[Any, ...]  # the positional arguments in order: TensorRefs and constants
    kwargs: Mapping[str, Any]

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return tuple(argument for argument in self.arguments if isinstance(argument, TensorRef))

    @property
    def constants(self) -> tuple[Any, ...]:
        return tuple(argument for argument in self.arguments if not isinstance(argument, TensorRef))

    @property
    def input_shapes(self) -> tuple[Shape, ...]:
        return tuple(ref.shape for ref in self.inputs)

    @property
    def shown_class(self) -> str:
        """The class as a user wrote it: ``Dense`` for Keras's layers, else module and class."""
        return self.class_name.removeprefix("keras.layers.")

    def refuse(self, problem: str) -> ImportRefused:
        return ImportRefused(f"keras layer {self.name!r} ({self.shown_class}): {problem}")

    def option(self, key: str, expected: Any, why: str) -> None:
        """Refuse unless config ``key`` is ``expected`` (a value, or a tuple of values)."""
        allowed = expected if isinstance(expected, tuple) else (expected,)
        value = self.config.get(key, allowed[0])
        if _plain(value) not in [_plain(item) for item in allowed]:
            raise self.refuse(f"{key}={value!r}: {why}")


@attrs.frozen
class Converter:
    """How one Keras class becomes plan layers; ``reads``: the call arguments it honours
    (any other one given a value is refused)."""

    convert: Callable[[Call], Conversion]
    reads: frozenset[str] = frozenset()


def _plain(value: Any) -> Any:
    """Config values as plain Python (tuples as lists) so that they compare."""
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value
