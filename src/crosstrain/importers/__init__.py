"""Models made with a framework, imported as plans: ``crosstrain import``.

Each framework's importer (``importers/keras.py``) turns a model into plan layers and
neutral weights; :mod:`crosstrain.importers.common` writes them as a TOML plan and a
``.safetensors`` file beside it, which the plan names as ``model.init``. Importing this
package imports no framework: each importer imports its own when it is called.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.core.errors import InputError, did_you_mean
from crosstrain.importers.common import ImportResult

Say = Callable[[str], None]


def say_note(line: str) -> None:
    """Where an import's notes go by default: one line each on stderr."""
    print(f"crosstrain: {line}", file=sys.stderr, flush=True)


def _keras_file(source: str, out: str | Path, weights: str | Path | None, overwrite: bool) -> ImportResult:
    from crosstrain.importers.keras import import_file

    return import_file(source, out, weights, overwrite)


#: what ``crosstrain import SOURCE --framework NAME`` runs for each framework
IMPORTERS: dict[str, Callable[[str, str | Path, str | Path | None, bool], ImportResult]] = {
    "keras": _keras_file,
}
#: the framework a saved model's file suffix tells, when --framework is not given
SUFFIXES = {".keras": "keras", ".h5": "keras"}


def import_model(
    source: str,
    out: str | Path,
    framework: str | None = None,
    weights: str | Path | None = None,
    overwrite: bool = False,
    say: Say = say_note,
) -> ImportResult:
    """Import ``source`` (a saved model's file) with ``framework``'s importer (default: the
    one its suffix tells) as the plan ``out`` and its weights; its notes go to ``say``."""
    if framework is None:
        framework = SUFFIXES.get(Path(source).suffix)
        if framework is None:
            known = ", ".join(sorted(SUFFIXES))
            raise InputError(f"{source}: which framework made it? name it with --framework (files: {known})")
    importer = IMPORTERS.get(framework)
    if importer is None:
        raise InputError(f"--framework {framework}: no such importer{did_you_mean(framework, IMPORTERS)}")
    result = importer(source, out, weights, overwrite)
    for note in result.notes:
        say(note)
    return result


def import_keras(
    model: Any,
    out: str | Path,
    weights: str | Path | None = None,
    overwrite: bool = False,
    say: Say = say_note,
) -> ImportResult:
    """A ``keras.Model`` (Sequential or Functional) as the plan ``out`` (TOML) and its
    weights (default ``init.safetensors`` beside it, which the plan's ``model.init`` names);
    its notes (a final softmax left out) go to ``say``."""
    from crosstrain.importers.keras import import_keras as convert_and_write

    result = convert_and_write(model, out, weights, overwrite)
    for note in result.notes:
        say(note)
    return result


__all__ = ["IMPORTERS", "ImportResult", "import_keras", "import_model"]
