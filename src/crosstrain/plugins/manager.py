"""The plugin manager: entry-point loading with pytest's hygiene, and the backend registry.

Built-in plugins and backends are entry points of the ``crosstrain`` group in
crosstrain's own distribution, loaded exactly as a third party's would be.
``CROSSTRAIN_DISABLE_PLUGIN_AUTOLOAD=1`` loads only those built-ins (and any named
with ``-p NAME``); ``-p no:NAME`` blocks one. An installed plugin that fails to import is
reported once, with its distribution, and the rest keep working; a plugin asked for with
``-p NAME`` that does not load, and a hook implementation whose name matches no hook
(a misspelling), are errors naming the plugin.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable
from typing import cast

import attrs
import pluggy

from crosstrain.core.admission.checks import check_framework
from crosstrain.core.errors import BackendError, PluginError
from crosstrain.core.run.job import PluginSelection
from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.plugins import hookspecs

GROUP = "crosstrain"
AUTOLOAD_OFF_VARIABLE = "CROSSTRAIN_DISABLE_PLUGIN_AUTOLOAD"
OWN_DISTRIBUTION = "crosstrain"


@attrs.frozen
class PluginFailure:
    name: str
    distribution: str
    error: str

    def message(self) -> str:
        return f"plugin {self.name!r} from distribution {self.distribution!r} failed to load: {self.error}"


@attrs.frozen
class BackendEntry:
    strategy: type[DistributedStrategy]
    distribution: str


class CrosstrainPluginManager(pluggy.PluginManager):
    """pluggy's manager plus the load failures it met, reported once by the CLI."""

    def __init__(self) -> None:
        super().__init__(GROUP)
        self.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self.distributions: dict[str, str] = {}


def selection_from_args(plugin_args: Iterable[str]) -> PluginSelection:
    """``-p NAME`` / ``-p no:NAME`` values plus the autoload variable, as one selection."""
    enabled: list[str] = []
    disabled: list[str] = []
    for value in plugin_args:
        if value.startswith("no:"):
            disabled.append(value[3:])
        else:
            enabled.append(value)
    autoload = os.environ.get(AUTOLOAD_OFF_VARIABLE, "") in ("", "0")
    return PluginSelection(autoload=autoload, enabled=tuple(enabled), disabled=tuple(disabled))


def make_plugin_manager(selection: PluginSelection = PluginSelection()) -> CrosstrainPluginManager:
    manager = CrosstrainPluginManager()
    for name in selection.disabled:
        manager.set_blocked(name)
    loaded: set[str] = set()
    for entry_point in importlib.metadata.entry_points(group=GROUP):
        distribution = entry_point.dist.name if entry_point.dist else "?"
        wanted = (
            selection.autoload or distribution == OWN_DISTRIBUTION or entry_point.name in selection.enabled
        )
        if not wanted or manager.is_blocked(entry_point.name) or entry_point.name in loaded:
            continue
        loaded.add(entry_point.name)
        _register(
            manager, entry_point.name, distribution, entry_point.load, entry_point.name in selection.enabled
        )
    for name in selection.enabled:
        if name not in loaded and not manager.is_blocked(name):
            _register(manager, name, "(-p)", functools.partial(importlib.import_module, name), True)
    check_hook_names(manager)
    return manager


def hook_relay(selection: PluginSelection) -> pluggy.HookRelay:
    """The hook relay of ``selection``'s plugins: what every worker calls, handed down to
    core in ``Job.load_hooks`` (core may not import this module)."""
    return make_plugin_manager(selection).hook


def _register(
    manager: CrosstrainPluginManager,
    name: str,
    distribution: str,
    load: Callable[[], object],
    asked_for: bool,
) -> None:
    """Load and register one plugin; one that fails to import is an error when the user
    named it with -p, else a warning and the rest keep working."""
    try:
        plugin = load()
    except Exception as error:  # any import error of a third party's code is reported, not fatal
        failure = PluginFailure(name, distribution, f"{type(error).__name__}: {error}")
        if asked_for:
            raise PluginError(f"-p {name}: {failure.message()}") from None
        manager.failures.append(failure)
        return
    try:
        manager.register(plugin, name=name)
    except pluggy.PluginValidationError as error:  # a hook with arguments its spec lacks
        raise PluginError(f"plugin {name!r} from distribution {distribution!r}: {error}") from None
    manager.distributions[name] = distribution


def check_hook_names(manager: CrosstrainPluginManager) -> None:
    """pluggy's check_pending, as one line naming the plugin, its distribution and the
    hook it probably meant: a misspelled hook would otherwise never be called."""
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        name = manager.get_name(error.plugin) or repr(error.plugin)
        distribution = manager.distributions.get(name, "?")
        unknown = [
            hook
            for hook, caller in vars(manager.hook).items()
            if not caller.has_spec() and any(i.plugin is error.plugin for i in caller.get_hookimpls())
        ]
        known = sorted(hook for hook, caller in vars(manager.hook).items() if caller.has_spec())
        hints = [
            f"{hook!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(hook, known, 1))
            else repr(hook)
            for hook in unknown
        ]
        raise PluginError(
            f"plugin {name!r} from distribution {distribution!r} implements unknown hook "
            f"{', '.join(hints)}; crosstrain's hooks: {', '.join(known)}"
        ) from None


def report_failures(manager: CrosstrainPluginManager) -> None:
    for failure in manager.failures:
        print(f"crosstrain: warning: {failure.message()}", file=sys.stderr)


def backend_registry(manager: CrosstrainPluginManager) -> dict[str, BackendEntry]:
    """Backend name -> class and providing distribution; a clash names both distributions."""
    registry: dict[str, BackendEntry] = {}
    plugin_of: dict[str, str] = {}
    for implementation in manager.hook.crosstrain_backends.get_hookimpls():
        plugin = implementation.plugin_name
        distribution = manager.distributions.get(plugin, plugin)
        strategies = cast(list[type[DistributedStrategy]], implementation.function())
        for strategy in strategies:
            earlier = registry.get(strategy.name)
            if earlier is not None and earlier.strategy is not strategy:
                both = sorted([(earlier.distribution, plugin_of[strategy.name]), (distribution, plugin)])
                named = " and ".join(f"{dist!r} (plugin {name!r})" for dist, name in both)
                raise BackendError(
                    f"backend {strategy.name!r} is registered by two distributions: {named}; "
                    f"uninstall one, or block one with -p no:PLUGIN"
                )
            registry[strategy.name] = BackendEntry(strategy, distribution)
            plugin_of[strategy.name] = plugin
    return registry


def get_backend(manager: CrosstrainPluginManager, name: str) -> type[DistributedStrategy]:
    """The backend class for ``name``; unknown names and missing frameworks fail clearly."""
    registry = backend_registry(manager)
    entry = registry.get(name)
    if entry is None:
        known = ", ".join(sorted(registry)) or "none"
        raise BackendError(f"unknown backend {name!r}; registered backends: {known}")
    check_framework(entry.strategy, name)  # admission asks again; a missing one fails here first
    return entry.strategy
