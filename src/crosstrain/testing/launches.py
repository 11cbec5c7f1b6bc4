"""The conformance suite's runs: its plans written out, each trained through the real
``crosstrain`` CLI in a subprocess, and the session's cache of them (:class:`RunCache`), so
that every check comparing with a run reads the same one, made once per pytest session."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from crosstrain.testing.data_plans import (
    IMAGE_FOLDER_PLAN,
    MULTILABEL_PLAN,
    SCALED_IMAGES_PLAN,
    TABLE_PLAN,
    write_churn_tables,
    write_image_folder,
    write_images,
    write_multilabel_data,
    write_tokens,
)
from crosstrain.testing.plans import DIGITS_MLP_PLAN, DROPOUT_MLP_PLAN, GPT_PLAN, RESNET_PLAN, VISION_PLAN
from crosstrain.testing.zoo import ZOO

PLANS = {
    "dropout_mlp": DROPOUT_MLP_PLAN,
    "resnet": RESNET_PLAN,
    "vision": VISION_PLAN,  # a ResNet's downsampling block and a MobileNetV2's inverted residual
    "scaled_images": SCALED_IMAGES_PLAN,  # uint8 npy scaled per channel where the model runs
    # the model zoo (examples/zoo), each run scaled down: ResNet-50, MobileNetV2, U-Net;
    # ViT-B/16 (class token, label smoothing, top-5 accuracy); GPT-2 small (token windows,
    # dropout, tied output, decay on kernels only); a Llama (RMS norm, SwiGLU, rotary
    # grouped-query attention without biases)
    **{name: model.text for name, model in ZOO.items()},
}
#: the ``--set`` settings every run of a plan starts with: the zoo's small versions
PLAN_SETTINGS: dict[str, tuple[str, ...]] = {name: model.small for name, model in ZOO.items()}
#: the shipped examples every backend trains whole
EXAMPLE_PLANS = {"digits_mlp": DIGITS_MLP_PLAN}
#: plans trained only by the tests that name them (not every backend's conformance suite):
#: binary cross-entropy, a table of text and numbers, an image folder with augmentation, a GPT
#: decoder (the GPU tests'; the zoo's GPT-2 small has every layer it has)
FEATURE_PLANS = {
    "gpt": GPT_PLAN,
    "multilabel": MULTILABEL_PLAN,
    "table": TABLE_PLAN,
    "image_folder": IMAGE_FOLDER_PLAN,
}
#: the steps of every run a check compares (``train.max_steps``)
STEPS = 12


def run_cli(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess: one thread per worker, quiet TensorFlow."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        TF_ENABLE_ONEDNN_OPTS="0",
        COLUMNS="200",
        **(env or {}),
    )
    return subprocess.run(
        [sys.executable, "-m", "crosstrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def write_plan(directory: Path, name: str) -> Path:
    """One of :data:`PLANS`, :data:`EXAMPLE_PLANS` or :data:`FEATURE_PLANS` in ``directory``,
    with the data it reads (the GPT's tokens, the zoo's arrays); a run of a zoo plan starts
    with its :data:`PLAN_SETTINGS`."""
    directory.mkdir(parents=True, exist_ok=True)
    if name == "gpt":
        write_tokens(str(directory / "tokens.npy"))
    if name == "scaled_images":
        write_images(str(directory))
    if name == "image_folder":
        write_image_folder(str(directory))
    if name == "multilabel":
        write_multilabel_data(str(directory / "multilabel.npz"))
    if name == "table":
        write_churn_tables(str(directory))
    if name in ZOO:
        ZOO[name].write_data(directory)
    path = directory / f"{name}.toml"
    path.write_text({**PLANS, **EXAMPLE_PLANS, **FEATURE_PLANS}[name])
    return path


def train(backend: str, plan: Path, out: Path, nproc: int, *settings: str, steps: int | None = STEPS) -> Path:
    """Train ``plan`` for ``steps`` steps (None: as long as the plan says); the run folder."""
    length = ("--set", f"train.max_steps={steps}") if steps is not None else ()
    result = run_cli(
        "-p", "no:progress", "run", str(plan), "--backend", backend, "--nproc", str(nproc),
        "--device", "cpu", "--out", str(out), *length, *settings,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (out / "stdout.txt").write_text(result.stdout)  # what the run printed, for the tests that read it
    return out


def train_refused(backend: str, plan: Path, out: Path, *settings: str) -> str:
    """A run the backend refuses before launch: exit 2, one line, nothing written; that line."""
    arguments = [item for setting in settings for item in ("--set", setting)]
    result = run_cli("run", str(plan), "--backend", backend, "--device", "cpu", "--out", str(out), *arguments)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip()
    assert line.count("\n") == 0, line
    assert not out.exists()
    return line


@attrs.frozen
class RunKey:
    """What makes a conformance run of :data:`STEPS` steps: the backend, a plan of
    :data:`PLANS` or :data:`FEATURE_PLANS`, the replicas, the ``--set`` settings and other
    ``crosstrain run`` flags (a layout such as ``--workers 2``)."""

    backend: str
    plan: str
    nproc: int
    settings: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()


def shared_folder(factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest-xdist worker of this session sees (the session's base
    temporary folder, above each worker's own); the session's own folder without xdist."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "shared"
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Held by one process of the session at a time (an advisory lock on ``lock``)."""
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def made_once(folder: Path, make: Callable[[Path], None]) -> Path:
    """``folder``, made by ``make`` once per session, whichever worker asks first; a worker
    asking while another makes it waits for it. A make that failed leaves nothing: the next
    worker to ask makes it again (and fails alike, naming the cause in its own test)."""
    with _exclusive(folder.with_name(folder.name + ".lock")):
        done = folder / ".made"
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            done.touch()
    return folder


#: a folder that keeps the conformance runs beyond one pytest session (tox sets it for every
#: env): the torch runs the torch env makes are the references the cross env's tf and the jax
#: plugin's session compare with, made once for all of them
RUNS_VARIABLE = "CROSSTRAIN_TEST_RUNS"
#: what a run of each backend depends on besides crosstrain's source: its frameworks'
#: distributions and the packages of a backend outside crosstrain (hashed as its source is)
BACKEND_DEPENDENCIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "torch": (("torch",), ()),
    "tf": (("tensorflow-cpu", "tensorflow", "keras"), ()),
    "jax": (("jax", "jaxlib"), ("crosstrain_jax",)),
}


def _hash_sources(digest: Any, package: str) -> None:
    spec = importlib.util.find_spec(package)  # found, not imported
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())


#: settings of the environment that change a run's numbers (the instruction sets the kernels
#: may use, threads)
NUMERIC_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "TF_ENABLE_ONEDNN_OPTS")


def source_fingerprint() -> str:
    """A digest of crosstrain's source (read, not imported), Python's version and
    :data:`NUMERIC_VARIABLES`: runs kept beyond a session are reused only by the same code
    computing the same way."""
    digest = hashlib.sha1(sys.version.encode())
    digest.update(repr([(name, os.environ.get(name)) for name in NUMERIC_VARIABLES]).encode())
    _hash_sources(digest, "crosstrain")
    return digest.hexdigest()[:12]


def backend_fingerprint(backend: str) -> str | None:
    """A digest of what runs on ``backend`` depend on beyond crosstrain (its frameworks'
    versions, its package's source); None for a backend not in :data:`BACKEND_DEPENDENCIES`,
    whose runs are kept for one session only."""
    if backend not in BACKEND_DEPENDENCIES:
        return None
    distributions, packages = BACKEND_DEPENDENCIES[backend]
    digest = hashlib.sha1(backend.encode())
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{name}=={importlib.metadata.version(name)}".encode())
    for package in packages:
        _hash_sources(digest, package)
    return digest.hexdigest()[:12]


def kept_runs_folder() -> Path | None:
    """The folder for runs kept beyond a session: :data:`RUNS_VARIABLE`'s, one subfolder per
    :func:`source_fingerprint` (the others, left by earlier code, are removed); None if unset."""
    kept = os.environ.get(RUNS_VARIABLE)
    if not kept:
        return None
    base = Path(kept)
    base.mkdir(parents=True, exist_ok=True)
    current = base / source_fingerprint()
    with _exclusive(base / ".lock"):
        for stale in base.iterdir():
            if stale.is_dir() and stale != current:
                shutil.rmtree(stale, ignore_errors=True)
        current.mkdir(exist_ok=True)
    return current


class RunCache:
    """Every conformance run made once per pytest session, whichever test of whichever
    pytest-xdist worker asks for it first: the world-N runs that a backend's suite compares,
    torch's reference runs that every backend agreeing with torch compares, the runs
    evaluate and predict read. A run's folder is only read by the tests that share it, so
    those tests may run in any worker."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.root = shared_folder(factory) / "runs"
        self.root.mkdir(exist_ok=True)
        #: where runs of the backends in BACKEND_DEPENDENCIES are kept beyond this session
        self.kept = kept_runs_folder()
        self.runs: dict[RunKey, Path] = {}

    def __call__(
        self, backend: str, plan: str, nproc: int, *settings: str, flags: tuple[str, ...] = ()
    ) -> Path:
        """The run of ``plan`` (a name in :data:`PLANS` or :data:`FEATURE_PLANS`) on
        ``backend`` at ``nproc`` replicas with ``settings``, launched with ``flags``."""
        key = RunKey(backend, plan, nproc, settings, flags)
        if key not in self.runs:
            digest = hashlib.sha1(repr(key).encode()).hexdigest()[:10]
            given = (*PLAN_SETTINGS.get(plan, ()), *settings)
            arguments = [item for setting in given for item in ("--set", setting)]

            def make(directory: Path) -> None:
                train(backend, write_plan(directory, plan), directory / "run", nproc, *arguments, *flags)

            backend_digest = backend_fingerprint(backend) if self.kept is not None else None
            root = self.kept / backend_digest if self.kept is not None and backend_digest else self.root
            root.mkdir(parents=True, exist_ok=True)
            folder = made_once(root / f"{plan}-{backend}-x{nproc}-{digest}", make)
            self.runs[key] = folder / "run"
        return self.runs[key]


RUNS = pytest.StashKey[RunCache]()


def session_runs(config: pytest.Config, factory: pytest.TempPathFactory) -> RunCache:
    """The session's :class:`RunCache` (kept in pytest's stash: one per session); a suite's
    own fixture can hand it to tests outside these classes that compare with the same runs."""
    return config.stash.setdefault(RUNS, RunCache(factory))


class SharesRuns:
    """A test class whose tests take the session's runs as the ``runs`` fixture."""

    @pytest.fixture
    def runs(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RunCache:
        """The session's :class:`RunCache`."""
        return session_runs(request.config, tmp_path_factory)
