"""Checkpoints: neutral names and channels-last layouts in safetensors, readable by any backend.

A run folder's periodic checkpoints (docs/checkpoints.md)::

    checkpoints/step-00000040/
        model.safetensors       weights (running statistics too) under neutral names
        optimizer.safetensors   optimizer.{weight}.{slot}: momentum | exp_avg | exp_avg_sq
        state.json              step, epoch, schedule, optimizer step and loss scale,
                                dropout counter, backend, plan hash (see LoopState)
        manifest.json           each file above: its size in bytes and its sha256

Each is written into ``checkpoints/.step-NNNNNNNN.tmp``, every file fsynced, the manifest
last, then renamed: a folder named ``step-NNNNNNNN`` is always complete, and a file damaged
after it was written (a full disk, a copy cut short) no longer matches its manifest
(:func:`verify_checkpoint`). Older ones are pruned only after the new one is in place.

Format 1 (written before checkpoints carried a manifest) has no manifest: it counts as
intact when its state.json parses and both safetensors files read whole, and its plan hash
includes ``train.epochs`` and ``train.max_steps`` (it continues only to its own end).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from crosstrain.core.errors import CheckpointError
from crosstrain.core.spec.plan import Plan

CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
#: 2: a manifest, and a plan hash without the run's length; 1: neither (see the module)
FORMAT_VERSION = 2
#: the plan fields that may change when a run continues (besides its output section):
#: its length, and how its replicas shard it (a checkpoint is neutral whatever the mode).
#: The plan hash leaves them out
LENGTH_FIELDS = ("epochs", "max_steps")
CONTINUED_FIELDS = (*LENGTH_FIELDS, "shard")
_STEP_FOLDER = re.compile(r"^step-(\d{8})$")
#: ``output.keep_best`` -> (eval metric, True when larger is better)
KEEP_BEST: dict[str, tuple[str, bool]] = {"eval.loss": ("loss", False), "eval.accuracy": ("accuracy", True)}
#: optimizer scalars kept in state.json rather than as tensors
_SCALARS = {"optimizer.step": ("optimizer", "step"), "loss_scale.scale": ("loss_scale", "scale")}
_SCALARS["loss_scale.growth_tracker"] = ("loss_scale", "growth_tracker")


class StreamedTensors(Mapping[str, np.ndarray]):
    """Tensors that a sharded backend reads one at a time (each read may gather the tensor
    from every rank's shard, a collective): a safetensors file of them is written as they
    come (:func:`write_safetensors`), so no process ever holds more than one whole tensor
    beyond its shards. Every rank reads them in the same order, the order of ``specs``
    (a rank that writes nothing reads them too: :func:`read_on_every_rank`).

    ``specs``: name -> (shape, dtype), in order; ``read``: the tensor of a name (as a numpy
    array of that shape and dtype)."""

    def __init__(
        self, specs: Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]], read: Callable[[str], np.ndarray]
    ) -> None:
        self.specs = dict(specs)
        self._read = read

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def without(self, names: Collection[str]) -> StreamedTensors:
        """The same stream less ``names`` (read lazily still)."""
        kept = {name: spec for name, spec in self.specs.items() if name not in names}
        return StreamedTensors(kept, self._read)


def read_on_every_rank(tensors: Mapping[str, np.ndarray]) -> None:
    """What a rank that writes nothing does while rank 0 writes ``tensors``: read each, in
    the writer's order, so the gathers they make meet rank 0's (a plain dict: nothing)."""
    if isinstance(tensors, StreamedTensors):
        for name in tensors:
            tensors[name]


#: numpy dtype -> safetensors' name of it (the dtypes a checkpoint holds)
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
    "bool": "BOOL",
}


def write_safetensors(path: Path, tensors: StreamedTensors, metadata: Mapping[str, str]) -> None:
    """A safetensors file written tensor by tensor: the header from ``tensors.specs`` (every
    size is known before any tensor is read), then each tensor as it is read, so the
    memory it takes is one tensor's. The format is safetensors' own (a little-endian u64
    header length, the JSON header padded to 8 bytes, the tensors back to back)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (shape, dtype) in tensors.specs.items():
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        kind = _SAFETENSORS_DTYPES[np.dtype(dtype).name]
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, (shape, dtype) in tensors.specs.items():
            value = np.ascontiguousarray(tensors[name], dtype=dtype)
            if value.shape != tuple(shape):
                raise ValueError(f"{name}: read as shape {list(value.shape)}, announced {list(shape)}")
            handle.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())


def save_checkpoint(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write atomically: a crash mid-write never replaces a good checkpoint with a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    if isinstance(tensors, StreamedTensors):
        write_safetensors(temporary, tensors, metadata)
    else:
        contiguous = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
        save_file(contiguous, str(temporary), metadata=dict(metadata))
    os.replace(temporary, path)


def load_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file; one that does not read (truncated, not safetensors)
    is a :class:`CheckpointError` naming it, never safetensors' own traceback."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({_first_line(error)})") from None


class TensorFile(Mapping[str, np.ndarray]):
    """A safetensors file's tensors, each read from the file when it is looked up: a run
    that resumes or starts from a checkpoint holds one whole tensor of it at a time (its
    backend keeps what it needs of each, a rank of a sharded run its shard), never the whole
    file. The header is read at once, so a file that does not read is refused up front.
    ``held``: small tensors kept beside the file's (a checkpoint's optimizer scalars)."""

    def __init__(self, path: Path, held: Mapping[str, np.ndarray] | None = None) -> None:
        self.path = Path(path)
        self._held = dict(held or {})
        self._names = tuple(dict.fromkeys((*tensor_shapes(self.path), *self._held)))

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._held:
            return self._held[name]
        if name not in self._names:
            raise KeyError(name)
        try:
            with safe_open(str(self.path), "np") as handle:
                return handle.get_tensor(name)  # type: ignore[no-any-return]
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{self.path}: {name} cannot be read ({_first_line(error)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape in a safetensors file, from its header alone."""
    try:
        with safe_open(str(path), "np") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118 (no __iter__)
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({_first_line(error)})") from None


def file_metadata(path: Path) -> dict[str, str]:
    """The metadata a safetensors file carries (the backend that wrote it, its step)."""
    try:
        with safe_open(str(path), "np") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({_first_line(error)})") from None


def weights_file(source: Path, flag: str = "--init-from") -> Path:
    """The weights ``--init-from`` names: a .safetensors file itself, a checkpoint folder's
    model.safetensors (verified against its manifest), or a run folder's final
    model.safetensors (its newest intact checkpoint's when the run kept no final model).
    ``flag``: what named it, for the error (``--init-from``, or a plan's ``model.init``)."""
    if source.is_file():
        if source.suffix != ".safetensors":
            raise CheckpointError(f"{flag} {source}: not a .safetensors file")
        return source
    if not source.is_dir():
        raise CheckpointError(f"{flag} {source}: no such file or folder")
    if (source / STATE_FILE).is_file():  # a checkpoint folder
        problem = verify_checkpoint(source)
        if problem is not None:
            raise CheckpointError(f"{flag} {source}: {problem}")
        return source / MODEL_FILE
    if (source / MODEL_FILE).is_file():
        return source / MODEL_FILE
    newest = choose_checkpoint(source).path
    if newest is None:
        raise CheckpointError(
            f"{flag} {source}: holds neither {MODEL_FILE} nor a checkpoint "
            f"(a run folder, one of its checkpoints/step-NNNNNNNN, or a .safetensors file)"
        )
    return newest / MODEL_FILE


def plan_hash(plan: Plan, *, with_length: bool = False) -> str:
    """What must not change between a run and its resumption: the whole plan but its
    ``output`` section (where and how often to write), its length (``train.epochs``,
    ``train.max_steps``: a run may continue to a new end) and ``train.shard`` (how the
    replicas hold it). ``with_length``: the hash format-1 checkpoints hold, which includes
    the length (format 1 predates sharding: its plans hold no ``train.shard``)."""
    from crosstrain.core.spec.plan_dicts import unstructure_plan

    raw = unstructure_plan(plan)
    raw.pop("output", None)
    if not with_length:
        raw["train"] = {key: value for key, value in raw["train"].items() if key not in CONTINUED_FIELDS}
    elif raw["train"].get("epochs") is None:
        raw["train"]["epochs"] = 1  # format 1 predates an unset train.epochs: its default was 1
    text = json.dumps(raw, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@attrs.frozen
class LoopState:
    """The loop's position and everything beyond the tensors that continuing needs."""

    step: int  # optimizer steps done
    epoch: int  # the epoch the next step belongs to
    step_in_epoch: int  # steps of that epoch already done: the sampler skips these batches
    backend: str
    plan_hash: str
    plan: str = "plan"
    #: the epoch's running train-loss sum and real rows, so its mean loss is the same resumed
    epoch_loss_sum: float = 0.0
    epoch_real_rows: int = 0
    #: the last evaluation's metrics and the step it ran at (what keep_best compares)
    eval: dict[str, float] = attrs.field(factory=dict)
    eval_step: int | None = None
    #: the learning rate of the next step (informational: core recomputes it from ``step``)
    next_lr: float = 0.0
    optimizer: dict[str, Any] = attrs.field(factory=dict)  # name, step
    loss_scale: dict[str, float] | None = None
    #: dropout masks hash (seed, step, ...): the step is the only counter there is
    rng: dict[str, int] = attrs.field(factory=dict)
    format: int = FORMAT_VERSION


@attrs.frozen
class Checkpoint:
    path: Path
    state: LoopState
    weights: Mapping[str, np.ndarray]  # read a tensor at a time (TensorFile)
    optimizer: Mapping[str, np.ndarray]  # slots and 0-d scalars, as SavesOptimizerState gives them


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_folder(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first; temporary folders are not."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_FOLDER.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def last_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def write_checkpoint(
    run_dir: Path,
    state: LoopState,
    weights: Mapping[str, np.ndarray],
    optimizer: Mapping[str, np.ndarray],
) -> Path:
    """Write a complete checkpoint folder atomically and return it."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_folder(state.step)
    temporary = root / f".{final.name}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)  # a torn one from a crash
    temporary.mkdir()
    slots, scalars = _split_scalars(optimizer)
    state = attrs.evolve(state, optimizer={**state.optimizer, **scalars.get("optimizer", {})})
    if "loss_scale" in scalars:
        state = attrs.evolve(state, loss_scale=scalars["loss_scale"])
    metadata = {"backend": state.backend, "step": str(state.step), "plan": state.plan}
    _save(temporary / MODEL_FILE, weights, metadata)
    _save(temporary / OPTIMIZER_FILE, slots, metadata)
    state_path = temporary / STATE_FILE
    state_path.write_text(json.dumps(attrs.asdict(state), indent=2, default=_json_number) + "\n")
    _fsync(state_path)
    _write_manifest(temporary, (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE))
    _fsync(temporary)
    if final.exists():  # the same step written again (a rerun after a restart): replace it
        shutil.rmtree(final)
    os.rename(temporary, final)
    _fsync(root)
    return final


def read_checkpoint(path: Path) -> Checkpoint:
    raw = read_state(path)
    try:
        state = LoopState(**raw)
    except TypeError as error:
        raise CheckpointError(f"{path / STATE_FILE}: not a crosstrain loop state ({error})") from None
    scalars = {}
    for name, (section, key) in _SCALARS.items():
        values = raw.get(section) or {}
        if key in values:
            scalars[name] = np.asarray(values[key], np.float64 if section == "loss_scale" else np.int64)
    return Checkpoint(path, state, TensorFile(path / MODEL_FILE), TensorFile(path / OPTIMIZER_FILE, scalars))


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint folder's state.json as a dict; one that does not parse names itself."""
    try:
        raw = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path / STATE_FILE}: cannot be read ({_first_line(error)})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / STATE_FILE}: not a crosstrain loop state")
    return raw


# --------------------------------------------------------------------------- trust


def _write_manifest(folder: Path, names: Iterable[str]) -> None:
    """Each file's size and sha256, written (and fsynced) after the files themselves."""
    files = {
        name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)} for name in names
    }
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=2) + "\n")
    _fsync(path)


def verify_checkpoint(path: Path) -> str | None:
    """None when the checkpoint folder is intact; else one sentence naming the damaged file.
    Format 2 against its manifest (sizes, then sha256); format 1 by reading every file."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return _readable_format_1(path)
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{manifest} cannot be read ({_first_line(error)})"
    for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
        if name not in expected:
            return f"{manifest} does not list {name}"
    for name, (size, digest) in expected.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} is damaged ({file.stat().st_size} bytes, its manifest says {size})"
        if _sha256(file) != digest:
            return f"{file} is damaged (its sha256 differs from its manifest's)"
    return None


def _readable_format_1(path: Path) -> str | None:
    """A checkpoint without a manifest: intact if its state parses and its tensors read."""
    try:
        read_state(path)
        for name in (MODEL_FILE, OPTIMIZER_FILE):
            load_checkpoint(path / name)
    except CheckpointError as error:
        return str(error)
    return None


@attrs.frozen
class ResumeChoice:
    """The newest intact checkpoint of a run folder and the newer ones skipped as damaged
    (each with the sentence naming its file)."""

    path: Path | None
    damaged: tuple[tuple[Path, str], ...] = ()


def choose_checkpoint(run_dir: Path) -> ResumeChoice:
    """The newest checkpoint that verifies; raise when there are checkpoints but none is
    intact (path None: the folder has no checkpoint at all)."""
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(complete_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return ResumeChoice(path, tuple(damaged))
        damaged.append((path, problem))
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {run_dir}: {damaged[0][1]}")
    return ResumeChoice(None)


def resume_point(run_dir: Path, plan: Plan) -> Checkpoint | None:
    """The newest intact checkpoint of ``run_dir``, checked against ``plan``; None if none."""
    path = choose_checkpoint(run_dir).path
    if path is None:
        return None
    check_written_by(path, plan)
    return read_checkpoint(path)


def check_written_by(path: Path, plan: Plan) -> None:
    """Refuse a checkpoint that another plan wrote (only its loop state is read)."""
    state = read_state(path)
    legacy = int(state.get("format", 1)) < 2
    written, mine = state.get("plan_hash"), plan_hash(plan, with_length=legacy)
    if written != mine:
        allowed = (
            "the output section"
            if legacy
            else "the output section, train.epochs, train.max_steps and train.shard"
        )
        raise CheckpointError(
            f"{path}: written by another plan (hash {written}, this plan's is {mine}); "
            f"only {allowed} may change on --resume"
        )


def prune(run_dir: Path, keep: int, keep_best: str | None = None) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (and the best by
    ``keep_best``); return what was removed. Called only once the newest one is complete."""
    found = complete_checkpoints(run_dir)
    kept = {path for _, path in found[-keep:]}
    best = best_checkpoint(run_dir, keep_best) if keep_best else None
    if best is not None:
        kept.add(best)
    removed = [path for _, path in found if path not in kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def best_checkpoint(run_dir: Path, keep_best: str) -> Path | None:
    """The checkpoint whose evaluation at its own step scored best (the earliest on a tie)."""
    metric, larger_is_better = KEEP_BEST[keep_best]
    best: tuple[float, Path] | None = None
    for step, path in complete_checkpoints(run_dir):
        raw = json.loads((path / STATE_FILE).read_text())
        value = (raw.get("eval") or {}).get(metric)
        if raw.get("eval_step") != step or value is None:
            continue
        score = -float(value) if larger_is_better else float(value)
        if best is None or score < best[0]:
            best = (score, path)
    return best[1] if best else None


def _split_scalars(
    optimizer: Mapping[str, np.ndarray],
) -> tuple[Mapping[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Slot tensors for optimizer.safetensors; 0-d scalars for state.json (streamed slots
    stay streamed: only the scalars are read here)."""
    scalars: dict[str, dict[str, Any]] = {}
    for name in optimizer:
        if name in _SCALARS:
            section, key = _SCALARS[name]
            scalars.setdefault(section, {})[key] = np.asarray(optimizer[name]).item()
    if isinstance(optimizer, StreamedTensors):
        return optimizer.without(_SCALARS), scalars
    return {name: value for name, value in optimizer.items() if name not in _SCALARS}, scalars


def _save(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    if isinstance(tensors, StreamedTensors):
        write_safetensors(path, tensors, metadata)
    else:
        save_file(
            {name: np.ascontiguousarray(value) for name, value in tensors.items()}, str(path), dict(metadata)
        )
    _fsync(path)


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk before the rename publishes it."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _json_number(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {value!r}")
