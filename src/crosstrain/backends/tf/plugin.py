"""Entry point of the tf backend; importable without tensorflow installed."""

from __future__ import annotations

from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.plugins.hookspecs import hookimpl


@hookimpl
def crosstrain_backends() -> list[type[DistributedStrategy]]:
    from crosstrain.backends.tf.strategy import TfStrategy

    return [TfStrategy]
