"""Plugin hygiene as in pytest: autoload off, -p / -p no:, broken plugins, duplicate backend names.

Third-party plugins are real distributions: a dist-info folder with entry_points.txt put on
sys.path, found by importlib.metadata exactly as an installed package is. The CLI runs in
pytest's process (it finds entry points anew on each call), on the null backend; the
built-in backends are blocked where the CLI would list them, since asking whether their
frameworks import would import them here.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.errors import BackendError, PluginError
from crosstrain.plugins.manager import backend_registry, make_plugin_manager, selection_from_args
from tests.conftest import InProcessCli

#: the null backend loaded and the frameworks' backends blocked: `crosstrain backends` and
#: `crosstrain run` import no framework
FRAMEWORK_FREE = ("-p", "crosstrain.testing.null", "-p", "no:torch", "-p", "no:tf")


def _install_fake_distribution(
    site: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    dist_info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "\n".join(f"{key} = {value}" for key, value in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[crosstrain]\n{lines}\n")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))


RECORDER = """
import os, crosstrain
@crosstrain.hookimpl
def crosstrain_train_start(context):
    if context.world.is_main:
        open(os.environ["HELLO_FILE"], "w").write("hello from a third-party plugin")
"""

CLASH = """
from crosstrain.plugins.hookspecs import hookimpl
@hookimpl
def crosstrain_backends():
    from tests.ghost_backend import GhostStrategy
    class Impostor(GhostStrategy):
        name = "torch"
    return [Impostor]
"""


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    """Put a folder of fake distributions on sys.path for this test; their modules are
    forgotten after it."""

    def put(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))  # (it also invalidates the import caches)
        for module in site.glob("*.py"):
            monkeypatch.delitem(sys.modules, module.stem, raising=False)

    return put


@pytest.fixture
def site(tmp_path: Path, on_path: Callable[[Path], None]) -> Path:
    folder = tmp_path / "site"
    _install_fake_distribution(folder, "hello-plugin", {"hello": "hello_plugin"}, {"hello_plugin": RECORDER})
    _install_fake_distribution(
        folder,
        "broken-plugin",
        {"broken": "broken_plugin"},
        {"broken_plugin": "raise ImportError('needs libfoo')\n"},
    )
    on_path(folder)
    return folder


def test_broken_plugin_is_reported_once_and_the_rest_work(site: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process(*FRAMEWORK_FREE, "backends")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "broken" in line]
    assert warnings == [
        "crosstrain: warning: plugin 'broken' from distribution 'broken-plugin' failed to "
        "load: ImportError: needs libfoo"
    ]
    assert " null " in result.stdout


def test_blocking_a_plugin_silences_it(site: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process(*FRAMEWORK_FREE, "-p", "no:broken", "backends")
    assert result.returncode == 0 and "broken" not in result.stderr


def test_autoload_off_loads_only_builtins_and_named_plugins(
    site: Path, tmp_path: Path, write_plan: Callable[..., Path], cli_in_process: InProcessCli
) -> None:
    hello = tmp_path / "hello.txt"
    args = ("run", str(write_plan()), "--backend", "null", "--device", "cpu", "--set", "train.max_steps=2")
    off = {"HELLO_FILE": str(hello), "CROSSTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = cli_in_process(*FRAMEWORK_FREE, *args, "--out", str(tmp_path / "a"), env=off)
    assert result.returncode == 0, result.stderr
    assert not hello.exists() and "broken" not in result.stderr  # third parties stay out
    assert (tmp_path / "a" / "metrics.jsonl").is_file()  # built-ins still load
    result = cli_in_process(*FRAMEWORK_FREE, "-p", "hello", *args, "--out", str(tmp_path / "b"), env=off)
    assert result.returncode == 0, result.stderr
    assert hello.read_text() == "hello from a third-party plugin"


def test_builtin_plugins_can_be_removed(
    tmp_path: Path, write_plan: Callable[..., Path], cli_in_process: InProcessCli
) -> None:
    result = cli_in_process(
        *FRAMEWORK_FREE,
        "-p",
        "no:metrics",
        "run",
        str(write_plan()),
        "--backend",
        "null",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--set",
        "train.max_steps=2",
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()


def test_two_distributions_claiming_one_backend_name(
    tmp_path: Path, on_path: Callable[[Path], None], cli_in_process: InProcessCli
) -> None:
    site = tmp_path / "clash-site"
    _install_fake_distribution(
        site, "impostor-backend", {"impostor": "impostor_plugin"}, {"impostor_plugin": CLASH}
    )
    on_path(site)
    result = cli_in_process("backends")
    assert result.returncode == 2
    assert (
        "backend 'torch' is registered by two distributions: 'crosstrain' (plugin 'torch') and "
        "'impostor-backend' (plugin 'impostor')" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_registry_in_process_lists_builtin_backends() -> None:
    registry = backend_registry(make_plugin_manager(selection_from_args([])))
    assert {"torch", "tf"} <= set(registry)
    assert registry["torch"].distribution == "crosstrain"


def test_unknown_backend_error_in_process() -> None:
    from crosstrain.plugins.manager import get_backend

    with pytest.raises(BackendError, match=r"unknown backend 'nosuch'; registered backends: .*torch"):
        get_backend(make_plugin_manager(), "nosuch")


MISSPELLED = """
import crosstrain
@crosstrain.hookimpl
def crosstrain_step_ended(context, step, epoch, lr, metrics):
    pass
"""


def test_a_plugin_asked_for_by_name_that_does_not_load_is_an_error(cli_in_process: InProcessCli) -> None:
    with pytest.raises(
        PluginError, match=r"^-p nosuch: plugin 'nosuch' .*No module named 'nosuch'"
    ) as caught:
        make_plugin_manager(selection_from_args(["nosuch"]))
    assert caught.value.exit_code == 2
    result = cli_in_process("-p", "nosuch", "backends")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "crosstrain: error: -p nosuch: plugin 'nosuch' from distribution '(-p)' failed to load: "
        "ModuleNotFoundError: No module named 'nosuch'"
    ]


def test_a_misspelled_hook_is_an_error_naming_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "misspelled.py").write_text(MISSPELLED)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as caught:
        make_plugin_manager(selection_from_args(["misspelled"]))
    assert str(caught.value).startswith(
        "plugin 'misspelled' from distribution '(-p)' implements unknown hook 'crosstrain_step_ended' "
        "(did you mean 'crosstrain_step_end'?); crosstrain's hooks: "
    )
    assert caught.value.exit_code == 2


def test_an_installed_plugin_with_a_misspelled_hook_stops_the_cli(
    tmp_path: Path, on_path: Callable[[Path], None], cli_in_process: InProcessCli
) -> None:
    site = tmp_path / "typo-site"
    _install_fake_distribution(site, "typo-plugin", {"typo": "typo_plugin"}, {"typo_plugin": MISSPELLED})
    on_path(site)
    result = cli_in_process("backends")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("crosstrain: error: plugin 'typo' from distribution 'typo-plugin' implements")
    blocked = cli_in_process(*FRAMEWORK_FREE, "-p", "no:typo", "backends")
    assert blocked.returncode == 0  # blocking it is the way out
