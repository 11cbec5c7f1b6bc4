"""The entry point crosstrain loads (``[project.entry-points.crosstrain] jax = ...``).

Importable without jax: ``crosstrain backends`` lists the backend and says whether
jax imports, instead of failing.
"""

from __future__ import annotations

from crosstrain import DistributedStrategy
from crosstrain.plugins.hookspecs import hookimpl


@hookimpl
def crosstrain_backends() -> list[type[DistributedStrategy]]:
    from crosstrain_jax.strategy import JaxStrategy

    return [JaxStrategy]
