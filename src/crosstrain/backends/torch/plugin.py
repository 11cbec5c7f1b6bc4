"""Entry point of the torch backend; importable without torch installed."""

from __future__ import annotations

from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.plugins.hookspecs import hookimpl


@hookimpl
def crosstrain_backends() -> list[type[DistributedStrategy]]:
    from crosstrain.backends.torch.strategy import TorchStrategy

    return [TorchStrategy]
