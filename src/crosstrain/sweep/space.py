"""``--search FIELD=SPACE`` and ``--objective METRIC``: the closed tables a sweep reads.

A space is ``log(a,b)`` (a float drawn on a log scale), ``uniform(a,b)``, ``int(a,b)``
(both ends included) or ``choice(v1,v2,...)`` (values written as in ``--set``: numbers,
true/false, or text). The field is any plan field ``--set`` takes; each space's values
are tried on the plan before the first trial starts, so a wrong field or value is refused
in one line naming it.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import attrs

from crosstrain.core.errors import InputError

Direction = Literal["minimize", "maximize"]


@attrs.frozen
class Objective:
    """A metric of a run's summary.json: ``section`` ("eval" or "train") and ``name``."""

    section: str
    name: str
    direction: Direction

    def value(self, summary: Mapping[str, Any]) -> float | None:
        found = (summary.get(self.section) or {}).get(self.name)
        return None if found is None else float(found)


#: --objective: the metrics a sweep can optimize, each with its direction
OBJECTIVES: Mapping[str, Objective] = {
    "eval_loss": Objective("eval", "loss", "minimize"),
    "eval_accuracy": Objective("eval", "accuracy", "maximize"),
    "eval_top_k_accuracy": Objective("eval", "top_k_accuracy", "maximize"),
    "train_loss": Objective("train", "loss", "minimize"),
}


@attrs.frozen
class Search:
    """One ``--search FIELD=SPACE``: the field, the space's kind and its arguments."""

    field: str
    kind: str
    values: tuple[Any, ...]

    def suggest(self, trial: Any) -> Any:
        """The trial's value (``trial``: an ``optuna.Trial``)."""
        return SPACES[self.kind].suggest(trial, self.field, self.values)

    def distribution(self) -> Any:
        """Optuna's distribution of this space (for ``study.ask``)."""
        return SPACES[self.kind].distribution(self.values)

    def examples(self) -> tuple[Any, ...]:
        """Values a trial may take, tried on the plan before any trial starts."""
        return self.values if self.kind == "choice" else (self.values[0], self.values[-1])


@attrs.frozen
class Space:
    arguments: str  # how the arguments read, for the error
    check: Callable[[tuple[Any, ...]], str | None]  # what is wrong with the arguments, or None
    suggest: Callable[[Any, str, tuple[Any, ...]], Any]
    distribution: Callable[[tuple[Any, ...]], Any]


def _pair(kind: type, positive: bool = False) -> Callable[[tuple[Any, ...]], str | None]:
    def check(values: tuple[Any, ...]) -> str | None:
        if len(values) != 2 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            return "two numbers"
        if kind is int and not all(isinstance(v, int) for v in values):
            return "two integers"
        if values[0] >= values[1]:
            return "a low end below the high end"
        if positive and values[0] <= 0:
            return "a low end above 0"
        return None

    return check


def _distributions() -> Any:
    import optuna.distributions

    return optuna.distributions


SPACES: Mapping[str, Space] = {
    "log": Space(
        "(low,high)",
        _pair(float, positive=True),
        lambda trial, name, v: trial.suggest_float(name, v[0], v[1], log=True),
        lambda v: _distributions().FloatDistribution(v[0], v[1], log=True),
    ),
    "uniform": Space(
        "(low,high)",
        _pair(float),
        lambda trial, name, v: trial.suggest_float(name, v[0], v[1]),
        lambda v: _distributions().FloatDistribution(v[0], v[1]),
    ),
    "int": Space(
        "(low,high)",
        _pair(int),
        lambda trial, name, v: trial.suggest_int(name, v[0], v[1]),
        lambda v: _distributions().IntDistribution(v[0], v[1]),
    ),
    "choice": Space(
        "(value,value,...)",
        lambda values: None if values else "at least one value",
        lambda trial, name, v: trial.suggest_categorical(name, list(v)),
        lambda v: _distributions().CategoricalDistribution(list(v)),
    ),
}

_SPACE = re.compile(r"^\s*(?P<kind>\w+)\s*\((?P<arguments>.*)\)\s*$")


def parse_search(text: str) -> Search:
    """``FIELD=SPACE`` as a :class:`Search`; anything else is an InputError naming it."""
    field, equals, space = text.partition("=")
    field = field.strip()
    if not equals or not field:
        raise InputError(f"--search {text!r}: write FIELD=SPACE, e.g. optimizer.lr=log(1e-4,1e-1)")
    match = _SPACE.match(space)
    kinds = ", ".join(f"{kind}{SPACES[kind].arguments}" for kind in SPACES)
    if match is None or match["kind"] not in SPACES:
        raise InputError(f"--search {field}: {space.strip()!r} is no space; the spaces: {kinds}")
    kind = match["kind"]
    values = tuple(_value(item) for item in match["arguments"].split(",") if item.strip())
    problem = SPACES[kind].check(values)
    if problem is not None:
        raise InputError(
            f"--search {field}: {kind}{SPACES[kind].arguments} needs {problem}, not {space.strip()}"
        )
    return Search(field, kind, values)


def _value(text: str) -> Any:
    """A value as ``--set`` reads it: a TOML literal (number, true/false, "text"), else the text."""
    try:
        return tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def override(field: str, value: Any) -> str:
    """``--set FIELD=VALUE`` of a trial's value, written as a TOML literal."""
    if isinstance(value, bool):
        return f"{field}={'true' if value else 'false'}"
    if isinstance(value, int | float):
        return f"{field}={value!r}"
    return f"{field}={_toml_string(str(value))}"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise InputError(f"--objective {name!r}: one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def unique_fields(searches: Iterable[Search]) -> None:
    seen: set[str] = set()
    for search in searches:
        if search.field in seen:
            raise InputError(f"--search {search.field}: searched twice")
        seen.add(search.field)
