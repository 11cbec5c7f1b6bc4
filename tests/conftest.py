"""Shared fixtures: small plans and data sets written to tmp_path, and CLI runners: the
real CLI in a subprocess, or in pytest's own process (``cli_in_process``)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest

from crosstrain.testing.launches import RunCache, session_runs

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
#: the marker of every test in a folder: tox picks each env's tests by marker
FOLDER_MARKERS = {"torch": "torch", "tf": "tf", "cross": "cross"}
#: the frameworks each folder's modules import at collection
FOLDER_FRAMEWORKS = {"torch": ("torch",), "tf": ("tensorflow",), "cross": ("torch", "tensorflow")}
#: folders whose frameworks this env lacks are not collected (their tests are another env's)
collect_ignore = [
    folder
    for folder, frameworks in FOLDER_FRAMEWORKS.items()
    if any(importlib.util.find_spec(name) is None for name in frameworks)
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/torch, tests/tf and tests/cross carries its folder's marker, so
    that a module which forgets its ``pytestmark`` still runs in its env, and only there.
    (The session's runs are made once whichever pytest-xdist worker asks first:
    :class:`crosstrain.testing.launches.RunCache`; so a test may run in any worker.)"""
    tests = Path(__file__).parent
    for item in items:
        folder = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])


MLP_PLAN = """
name = "tiny_mlp"
seed = 3
[model]
input_shape = [64]
layers = [{ type = "dense", units = 32 }, { type = "relu" }, { type = "dense", units = 10 }]
[data]
source = "digits"
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
[train]
global_batch_size = 32
epochs = 1
"""


@pytest.fixture
def write_plan(tmp_path: Path) -> Callable[..., Path]:
    """Write a TOML plan (dedented) into tmp_path and return its path."""

    def write(text: str = MLP_PLAN, name: str = "plan.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    """The conformance suite's runs of this session, for a test that compares with a run the
    suite makes anyway (world N on one machine, two tf workers, ...): made once, shared."""
    return session_runs(request.config, tmp_path_factory)


@pytest.fixture
def odd_npz(tmp_path: Path) -> Path:
    """A 203-row classification set: not a multiple of any batch size the tests use."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(203, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=203)
    path = tmp_path / "odd.npz"
    np.savez(path, x=x, y=y)
    return path


def worker_env() -> dict[str, str]:
    """Environment for CLI subprocesses: one thread each, quiet TF, keras.json kept out of $HOME."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    env.setdefault("KERAS_HOME", str(Path(os.environ.get("TMPDIR", "/tmp")) / "crosstrain-keras"))
    return env


def user_env() -> dict[str, str]:
    """:func:`worker_env` without its quiet TensorFlow: a user's shell, which sets neither,
    for a check that crosstrain itself keeps the frameworks quiet."""
    env = worker_env()
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS"):
        env.pop(name)
    return env


def run_cli(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real `crosstrain` CLI in a subprocess (as a user would) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "crosstrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or worker_env(),
        cwd=cwd,
    )


def json_from_fresh_process(entry: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``module:function`` in a fresh Python process (TensorFlow's devices must be set up
    before its first op, so never in pytest's process) and return the JSON its last line prints."""
    module, function = entry.split(":")
    result = subprocess.run(
        [sys.executable, "-c", f"from {module} import {function}; {function}()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=worker_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def run_cli_together(
    *runs: tuple[list[str], dict[str, str]], timeout: float = 120
) -> list[subprocess.CompletedProcess[str]]:
    """Run several `crosstrain` CLIs at once (the launchers of several "machines", or the
    processes an outside launcher such as srun starts), each with its arguments and
    environment; wait for all, and kill the rest when one overruns the timeout."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "crosstrain.cli", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for args, env in runs
    ]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [
        subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        for process, (stdout, stderr) in zip(processes, outputs, strict=True)
    ]


class InProcessCli(Protocol):
    def __call__(
        self,
        *args: str,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        terminal: bool = False,
    ) -> subprocess.CompletedProcess[str]: ...


class TerminalOutput(io.StringIO):
    """What a terminal shows: stdout and stderr in one stream that says it is a tty."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def cli_in_process(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> InProcessCli:
    """``crosstrain.cli.main(args)`` in this process, as :func:`run_cli` runs it in another:
    its exit code and what it wrote, with ``env`` set (a None value unsets the variable) and
    ``cwd`` the working directory for the call only. ``terminal``: stdout and stderr are one
    tty-like stream (returned as stdout), as a pseudo-terminal would be. The CLI reads the
    environment and finds plugins (entry points on ``sys.path``) anew on each call, so calls
    do not leak into each other; with the null backend (``-p crosstrain.testing.null
    --backend null``) training runs here too, without a framework."""
    from crosstrain.cli import main

    def run(
        *args: str,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        terminal: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()  # what came before is not this call's
        screen = TerminalOutput()
        with monkeypatch.context() as patch:
            for name, value in (env or {}).items():
                if value is None:
                    patch.delenv(name, raising=False)
                else:
                    patch.setenv(name, value)
            if cwd is not None:
                patch.chdir(cwd)
            if terminal:
                patch.setattr(sys, "stdout", screen)
                patch.setattr(sys, "stderr", screen)
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse's usage errors (2) and --help (0)
                code = exit.code if isinstance(exit.code, int) else 1
        out, err = capsys.readouterr()
        if terminal:
            out, err = screen.getvalue(), ""
        return subprocess.CompletedProcess(["crosstrain", *args], code, out, err)

    return run
