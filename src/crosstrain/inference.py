"""After training: evaluate, predict and export a finished run folder (the CLI's
``evaluate``, ``predict`` and ``export``, from Python).

A run folder holds the plan as run (``plan.json``), the final weights
(``model.safetensors``) and its checkpoints (``checkpoints/step-NNNNNNNN/``), all under
neutral names, so any backend rebuilds the model: a run trained on torch evaluates on tf
to the same numbers within parity tolerance. Everything here runs in this process, at
world 1: core's exact :func:`~crosstrain.core.run.evaluation.evaluate` over the plan's eval set, the
backend's ``build`` and ``load_state_dict``, and its optional ``predict``/``export``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from crosstrain.core.admission.runfolder import read_classes, read_run_plan, run_plan_source
from crosstrain.core.data.batches import ArrayDataset
from crosstrain.core.data.scaling import InputScaling, ScaledRows
from crosstrain.core.data.sources.images import IMAGE_SUFFIXES, ImageRows, check_image_headers
from crosstrain.core.data.sources.table import STATISTICS_FILE, TABLE_FORMATS, read_statistics
from crosstrain.core.errors import BackendError, InputError, PlanError
from crosstrain.core.model.graph import MODEL_INPUT
from crosstrain.core.model.layers import Embedding
from crosstrain.core.run.checkpoint import (
    MODEL_FILE,
    TensorFile,
    complete_checkpoints,
    file_metadata,
    step_folder,
)
from crosstrain.core.run.evaluation import evaluate
from crosstrain.core.run.loading import image_classes, load_datasets, read_table_rows
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.run.strategy import DistributedStrategy, Exports, Predicts, RunsLocally
from crosstrain.core.run.targets import TargetMisfit, fit_targets
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.vocabulary import SpeaksVocabulary, check_plan_vocabulary
from crosstrain.plugins.manager import (
    CrosstrainPluginManager,
    backend_registry,
    get_backend,
    make_plugin_manager,
)

LocalDevice = Literal["cpu", "gpu"]
#: rows handed to the backend's predict at once
PREDICT_ROWS = 1024
#: rows of the plan's data an export checks its files on
EXPORT_CHECK_ROWS = 16


@attrs.frozen
class TrainedModel:
    """A run's plan and one set of its weights (neutral names), and where they came from."""

    run_dir: Path
    plan: Plan
    weights: Mapping[str, np.ndarray]  # read from weights_file a tensor at a time
    weights_file: Path
    trained_on: str  # the backend that wrote the weights


def open_run(run: str | Path, checkpoint: str | None = None) -> TrainedModel:
    """The run's plan and its final weights, or those of the checkpoint named
    ``step-NNNNNNNN`` (or just its step number)."""
    run_dir = Path(run)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run folder")
    plan = read_run_plan(run_dir)
    if plan.model.native is not None:
        _import_beside(run_plan_source(run_dir))
    path = _weights_file(run_dir, checkpoint)
    weights = TensorFile(path)  # a damaged file is one line naming it
    return TrainedModel(run_dir, plan, weights, path, file_metadata(path).get("backend", ""))


def _import_beside(source: Path | None) -> None:
    """A native model's factory module may sit next to the plan file, as in training."""
    if source is not None and source.parent.is_dir() and str(source.parent) not in sys.path:
        sys.path.insert(0, str(source.parent))


def _weights_file(run_dir: Path, checkpoint: str | None) -> Path:
    found = {path.name: path for _, path in complete_checkpoints(run_dir)}
    have = ", ".join(found) or "none"
    if checkpoint is None:
        path = run_dir / MODEL_FILE
        if not path.is_file():
            raise InputError(
                f"{path}: no such file (the plan set output.checkpoint = false, or the run "
                f"stopped early); name a checkpoint with --checkpoint (complete ones: {have})"
            )
        return path
    name = step_folder(int(checkpoint)) if checkpoint.isdigit() else checkpoint
    if name not in found:
        raise InputError(
            f"--checkpoint {checkpoint}: no complete checkpoint of that name in {run_dir} (have: {have})"
        )
    return found[name] / MODEL_FILE


def backend_for(
    model: TrainedModel, backend: str | None, manager: CrosstrainPluginManager
) -> type[DistributedStrategy]:
    """The backend class (by default the one that trained the run); a native model's
    weights are its framework's own, so only that backend reads them."""
    name = backend or model.trained_on
    try:
        strategy = get_backend(manager, name)
    except BackendError as error:
        raise InputError(f"--backend {name}: {error}") from None
    if model.plan.model.native is not None and model.trained_on and name != model.trained_on:
        raise InputError(
            f"--backend {name}: the run's model is a native {model.trained_on} model, whose weights "
            f"only {model.trained_on} reads; use --backend {model.trained_on}"
        )
    return strategy


def local_strategy(strategy: type[DistributedStrategy], device: LocalDevice) -> DistributedStrategy:
    """A world-1 strategy in this process on ``device``."""
    if issubclass(strategy, RunsLocally):
        return strategy.local(device)
    if device != "cpu":
        raise InputError(
            f"--device {device}: the {strategy.name} backend runs in this process on the CPU only"
        )
    return strategy()


def build_trained(strategy: DistributedStrategy, model: TrainedModel, plan: Plan | None = None) -> Any:
    """The backend's state holding the run's weights (built as training builds it)."""
    plan = plan or model.plan
    if isinstance(strategy, SpeaksVocabulary):
        check_plan_vocabulary(plan, strategy.vocabulary(), strategy.name)
    state = strategy.build(plan, initial_weights(plan))
    try:
        strategy.load_state_dict(state, model.weights)
    except (KeyError, ValueError) as error:
        raise InputError(f"{model.weights_file}: does not fit the run's model: {error}") from None
    return state


# --------------------------------------------------------------------------- evaluate


def evaluate_run(
    run: str | Path,
    backend: str | None = None,
    checkpoint: str | None = None,
    device: LocalDevice = "cpu",
    manager: CrosstrainPluginManager | None = None,
    data: str | Path | None = None,
    labels: str | Path | None = None,
) -> dict[str, Any]:
    """The eval metrics (loss, accuracy where the plan has it, count) of the run's model
    over the plan's eval set, exactly as training computes them, on any backend; or over
    the rows of ``data`` (raw, scaled as in training) and ``labels`` (.npy files) instead,
    or over a table (.csv, .parquet: a table run's features and label columns, coded and
    scaled by the run's statistics)."""
    if data is not None and is_table_file(data):
        if labels is not None:
            raise InputError(f"--labels {labels}: a table's labels are its label column; leave --labels out")
    elif (data is None) != (labels is None):
        given, missing = ("--data", "--labels") if labels is None else ("--labels", "--data")
        raise InputError(f"{given} needs {missing}: evaluate reads rows and their labels together")
    model = open_run(run, checkpoint)
    strategy_class = backend_for(model, backend, manager or make_plugin_manager())
    dataset = _eval_set(model, data, labels)
    strategy = local_strategy(strategy_class, device)
    state = build_trained(strategy, model)
    metrics = evaluate(strategy, state, dataset, model.plan)
    result = {
        "run": str(model.run_dir),
        "weights": str(model.weights_file),
        "trained_on": model.trained_on,
        "backend": strategy.name,
        "eval": metrics,
    }
    if data is not None:
        result["data"] = str(data)
    if labels is not None:
        result["labels"] = str(labels)
    return result


def _eval_set(model: TrainedModel, data: str | Path | None, labels: str | Path | None) -> ArrayDataset:
    """The rows of ``data`` with ``labels`` (or a table's), else the plan's eval set."""
    if data is not None and is_table_file(data):
        x, y = read_table_rows(_table_plan(model, data), str(data), model.run_dir, "--data", with_label=True)
        assert y is not None
        return ArrayDataset(x, y)
    if data is not None and labels is not None:
        x = read_rows(data, model.plan, run_scaling(model))
        return ArrayDataset(x, read_labels(labels, len(x), data, model.plan))
    _check_run_classes(model)
    datasets = load_datasets(model.plan, model.run_dir)
    if datasets.eval is None:
        raise InputError(
            f"{model.run_dir}: the plan has no eval set (data.eval_fraction = 0, no eval path); "
            "give --data X.npy --labels Y.npy"
        )
    return datasets.eval


def is_table_file(path: str | Path) -> bool:
    """A .csv or .parquet file: read as a table, not as a .npy array."""
    return Path(path).suffix.lower() in TABLE_FORMATS


def _table_plan(model: TrainedModel, data: str | Path) -> Plan:
    """The run's plan, which must read a table for ``--data`` to be one."""
    if model.plan.data.source != "table":
        raise InputError(
            f"--data {data}: a table, but the run trained on data.source {model.plan.data.source!r}; "
            "give rows of model.input_shape as a .npy file"
        )
    return model.plan


def _check_run_classes(model: TrainedModel) -> None:
    """An image run's classes (its ``classes.json``) are still its files' classes: a label
    means the class it meant in training."""
    kept = read_classes(model.run_dir)
    if model.plan.data.source != "images" or kept is None:
        return
    found = image_classes(model.plan)
    if found != kept:
        raise InputError(
            f"{model.plan.data.path}: its classes ({', '.join(found)}) are no longer the run's "
            f"({', '.join(kept)}, {model.run_dir / 'classes.json'})"
        )


def read_labels(path: str | Path, rows: int, data: str | Path, plan: Plan) -> np.ndarray:
    """The targets of ``rows`` rows from a ``.npy`` file, checked against the model's
    output as training checks its data's."""
    labels = np.asarray(_open_npy(Path(path), "--labels"))
    if labels.ndim == 0 or len(labels) != rows:
        count = len(labels) if labels.ndim else 0
        raise InputError(f"--labels {path}: {count} rows, but --data {data} has {rows}")
    if labels.dtype.kind not in "iuf":
        raise InputError(f"--labels {path}: dtype {labels.dtype} is not a number type")
    try:
        return fit_targets(labels, plan)
    except TargetMisfit as misfit:
        raise InputError(f"--labels {path}: {misfit} (array {list(labels.shape)})") from None


# --------------------------------------------------------------------------- predict


def read_rows(path: str | Path, plan: Plan, scaling: InputScaling | None = None) -> np.ndarray:
    """Rows from a ``.npy`` file, checked against the model's input and scaled as in
    training (``scaling``, by default ``data.scale``/``mean``/``std``): float32, or int32
    token ids. An image run also reads an image file, or a folder's images (every
    .jpg/.jpeg/.png under it, sorted by path), decoded as its evaluation decodes them
    (the centre box)."""
    path = Path(path)
    if plan.data.source == "images" and (path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES):
        return _read_images(path, plan)
    raw = _open_npy(path, "--data")
    shape = tuple(plan.model.input_shape)
    # as in training: rows of the input's shape, or of its size (flat rows are reshaped)
    if raw.ndim < 2 or (raw.shape[1:] != shape and int(np.prod(raw.shape[1:])) != int(np.prod(shape))):
        raise InputError(
            f"--data {path}: rows have shape {list(raw.shape[1:])} (array {list(raw.shape)}), "
            f"model.input_shape is {list(shape)}; give [rows, {', '.join(map(str, shape))}]"
        )
    integer = raw.dtype.kind in "iu"
    if plan.model.input_dtype == "int32" and not integer:
        raise InputError(
            f"--data {path}: dtype {raw.dtype}, but model.input_dtype 'int32' needs integer token ids"
        )
    if not integer and raw.dtype.kind != "f":
        raise InputError(f"--data {path}: dtype {raw.dtype} is not a number type")
    rows = np.asarray(raw).reshape(len(raw), *shape)
    if plan.model.input_dtype == "int32":
        _check_token_ids(path, rows, plan)
        return rows.astype(np.int32)
    return (scaling or plan.data.scaling).apply(rows)


def run_scaling(model: TrainedModel) -> InputScaling:
    """The scaling the run's inputs were trained with: a standardised table's kept
    statistics, else the plan's ``data.scale``/``mean``/``std``."""
    if model.plan.data.source == "table" and model.plan.data.standardize:
        statistics = read_statistics(model.run_dir)
        if statistics is None:
            raise InputError(
                f"{model.run_dir}: no {STATISTICS_FILE}, which a run with data.standardize writes"
            )
        return statistics.scaling()
    return model.plan.data.scaling


def _read_images(path: Path, plan: Plan) -> np.ndarray:
    """The images ``path`` is or holds, as the model's rows."""
    assert plan.data.image_size is not None
    files = (
        sorted(str(file) for file in path.rglob("*") if file.suffix.lower() in IMAGE_SUFFIXES)
        if path.is_dir()
        else [str(path)]
    )
    if not files:
        raise InputError(f"--data {path}: no images ({', '.join(IMAGE_SUFFIXES)})")
    try:
        check_image_headers(files, "--data", None)
    except PlanError as error:
        raise InputError(f"--data {error.message}") from None
    rows = ImageRows(np.asarray(files), plan.data.image_size, antialias=plan.data.antialias)
    return plan.data.scaling.apply(rows.read(np.arange(len(files))))


def _open_npy(path: Path, flag: str) -> np.ndarray:
    """A ``.npy`` file, memory-mapped; refused in one line naming ``flag`` and the file."""
    if not path.is_file():
        raise InputError(f"{flag} {path}: no such file")
    with path.open("rb") as handle:
        if handle.read(6) != b"\x93NUMPY":
            raise InputError(f"{flag} {path}: not a .npy file (write it with numpy.save)")
    try:
        array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise InputError(f"{flag} {path}: not a .npy array ({error})") from None
    return array


def _check_token_ids(path: Path, rows: np.ndarray, plan: Plan) -> None:
    """Token ids index the embeddings that read the model's input: out of range is refused
    here, not met as a framework's index error."""
    if plan.model.native is not None or rows.size == 0:
        return
    for node in plan.model.graph(plan.source).nodes:
        if isinstance(node.layer, Embedding) and MODEL_INPUT in node.inputs:
            low, high = int(rows.min()), int(rows.max())
            if low < 0 or high >= node.layer.vocab_size:
                raise InputError(
                    f"--data {path}: token ids from {low} to {high}, but {node.field} has "
                    f"vocab_size {node.layer.vocab_size}"
                )


def predict_rows(strategy: DistributedStrategy, state: Any, x: np.ndarray) -> np.ndarray:
    """The backend's outputs for every row of ``x``, a chunk at a time."""
    if not isinstance(strategy, Predicts):
        raise InputError(f"--backend {strategy.name}: the backend cannot predict (it has no predict())")
    chunks = [
        strategy.predict(state, x[start : start + PREDICT_ROWS]) for start in range(0, len(x), PREDICT_ROWS)
    ]
    return np.concatenate(chunks) if chunks else np.zeros((0,), np.float32)


def predict_run(
    run: str | Path,
    data: str | Path,
    out: str | Path,
    backend: str | None = None,
    checkpoint: str | None = None,
    device: LocalDevice = "cpu",
    manager: CrosstrainPluginManager | None = None,
) -> np.ndarray:
    """The model's outputs (logits) for every row of ``data``, written to ``out`` with
    np.save (atomically) and returned."""
    model = open_run(run, checkpoint)
    strategy_class = backend_for(model, backend, manager or make_plugin_manager())
    if is_table_file(data):
        x, _ = read_table_rows(_table_plan(model, data), str(data), model.run_dir, "--data", with_label=False)
    else:
        x = read_rows(data, model.plan, run_scaling(model))
    out_path = Path(out)
    if not out_path.parent.is_dir():
        raise InputError(f"--out {out_path}: folder {out_path.parent} does not exist")
    strategy = local_strategy(strategy_class, device)
    outputs = predict_rows(strategy, build_trained(strategy, model), x)
    temporary = out_path.with_name(out_path.name + ".tmp")
    with temporary.open("wb") as handle:
        np.save(handle, outputs)
    os.replace(temporary, out_path)
    return outputs


# --------------------------------------------------------------------------- export


def export_formats(manager: CrosstrainPluginManager) -> dict[str, str]:
    """``--format`` name -> the backend that writes it, over every registered backend."""
    formats: dict[str, str] = {}
    for name, entry in sorted(backend_registry(manager).items()):
        if issubclass(entry.strategy, Exports):
            for format_name in entry.strategy().export_formats():
                formats.setdefault(format_name, name)
    return formats


def export_run(
    run: str | Path,
    format_name: str,
    out: str | Path | None = None,
    checkpoint: str | None = None,
    manager: CrosstrainPluginManager | None = None,
) -> list[Path]:
    """Files that ``format_name``'s framework loads without crosstrain (``torch``: an
    ExportedProgram and a state_dict; ``keras``: a ``.keras`` model), written under ``out``
    (default: ``RUN/export-FORMAT``), checked against crosstrain's own outputs. The model
    is exported in float32, whatever precision it trained in, and takes the raw rows
    ``predict`` takes: it applies the plan's input scaling itself."""
    manager = manager or make_plugin_manager()
    formats = export_formats(manager)
    if format_name not in formats:
        raise InputError(
            f"--format {format_name}: unknown format (known: {', '.join(sorted(formats)) or 'none'})"
        )
    model = open_run(run, checkpoint)
    backend = formats[format_name]
    if model.plan.model.native is not None and model.trained_on and backend != model.trained_on:
        raise InputError(
            f"--format {format_name}: the run's model is a native {model.trained_on} model; "
            f"only {model.trained_on}'s formats export it"
        )
    target = Path(out) if out is not None else model.run_dir / f"export-{format_name}"
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InputError(f"--out {target}: already exists and is not an empty folder")
    plan = _float32(_with_kept_statistics(model))
    strategy = local_strategy(backend_for(model, backend, manager), "cpu")
    state = build_trained(strategy, model, plan)
    assert isinstance(strategy, Exports)  # export_formats lists only backends that export
    return strategy.export(state, format_name, target, _sample_rows(plan))


def _with_kept_statistics(model: TrainedModel) -> Plan:
    """The run's plan, a standardised table's kept statistics (its statistics.json) written
    into it as ``data.mean``/``std``: the scaling an exported model applies to raw rows."""
    if not model.plan.data.standardize:
        return model.plan
    scaling = run_scaling(model)
    data = attrs.evolve(
        model.plan.data, standardize=False, scale=scaling.scale, mean=scaling.mean, std=scaling.std
    )
    return attrs.evolve(model.plan, data=data)


def _float32(plan: Plan) -> Plan:
    """The plan computing in float32, uncompiled: what an exported model runs."""
    return attrs.evolve(plan, train=attrs.evolve(plan.train, precision="fp32", compile=False))


def _sample_rows(plan: Plan) -> np.ndarray:
    """A few rows of the plan's data as ``predict`` reads them: raw, before the plan's
    input scaling (an export applies it itself)."""
    datasets = load_datasets(plan)
    rows = datasets.eval if datasets.eval is not None else datasets.train
    count = min(EXPORT_CHECK_ROWS, len(rows))
    x = rows.x.raw if isinstance(rows.x, ScaledRows) else rows.x
    return np.asarray(x[np.arange(count)])


def evaluation_rows(metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """(name, value) of the eval metrics, for a table."""
    rows = [("loss", f"{metrics['loss']:.6f}")]
    for name in ("accuracy", "top_k_accuracy", "perplexity"):
        if name in metrics:
            rows.append((name, f"{metrics[name]:.6f}"))
    rows.append(("count", f"{metrics['count']:.0f}"))
    return rows
