"""crosstrain's plugin system: hookspecs, the plugin manager and the built-in plugins."""

from crosstrain.plugins.hookspecs import hookimpl, hookspec

__all__ = ["hookimpl", "hookspec"]
