"""Models made with a framework, imported as plans: ``crosstrain import``.

Each framework's importer (``importers/keras.py``, ``importers/torch.py``) turns a model into plan layers and
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
from crosstrain.core.model.layers import Shape
from crosstrain.importers.common import ImportResult

Say = Callable[[str], None]
#: an importer: source, --out, --weights, --overwrite, --input-shape
Importer = Callable[[str, str | Path, str | Path | None, bool, Shape | None], ImportResult]


def say_note(line: str) -> None:
    """Where an import's notes go by default: one line each on stderr."""
    print(f"crosstrain: {line}", file=sys.stderr, flush=True)


def _keras_file(
    source: str, out: str | Path, weights: str | Path | None, overwrite: bool, input_shape: Shape | None
) -> ImportResult:
    from crosstrain.importers.keras import import_file

    if input_shape is not None:
        raise InputError("--input-shape: a Keras model records its own input shape; leave it out")
    return import_file(source, out, weights, overwrite)


def _torch_factory(
    source: str, out: str | Path, weights: str | Path | None, overwrite: bool, input_shape: Shape | None
) -> ImportResult:
    from crosstrain.importers.torch import import_factory

    if input_shape is None:
        raise InputError(
            "--input-shape: a torch module does not record its input; give one row channels-last (32,32,3)"
        )
    return import_factory(source, input_shape, out, weights, overwrite)


#: what ``crosstrain import SOURCE --framework NAME`` runs for each framework
IMPORTERS: dict[str, Importer] = {
    "keras": _keras_file,
    "torch": _torch_factory,
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
    input_shape: Shape | None = None,
) -> ImportResult:
    """Import ``source`` (a saved model's file, or a torch module's ``module:factory``) with
    ``framework``'s importer (default: the one its suffix tells) as the plan ``out`` and its
    weights; ``input_shape`` (one row, channels-last) for a torch module; notes go to ``say``."""
    if framework is None:
        framework = SUFFIXES.get(Path(source).suffix)
        if framework is None:
            known = ", ".join(sorted(SUFFIXES))
            raise InputError(f"{source}: which framework made it? name it with --framework (files: {known})")
    importer = IMPORTERS.get(framework)
    if importer is None:
        raise InputError(f"--framework {framework}: no such importer{did_you_mean(framework, IMPORTERS)}")
    result = importer(source, out, weights, overwrite, input_shape)
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


def import_torch(
    module: Any,
    input_shape: Shape,
    out: str | Path,
    weights: str | Path | None = None,
    overwrite: bool = False,
    say: Say = say_note,
) -> ImportResult:
    """A torch ``nn.Module`` (traced with torch.fx) as the plan ``out`` (TOML) and its weights
    (default ``init.safetensors`` beside it); ``input_shape`` is one row, channels-last."""
    from crosstrain.importers.common import write_import
    from crosstrain.importers.torch import convert_module

    result = write_import(
        convert_module(module, tuple(input_shape), type(module).__name__), out, weights, overwrite
    )
    for note in result.notes:
        say(note)
    return result


__all__ = ["IMPORTERS", "ImportResult", "import_keras", "import_model", "import_torch"]
