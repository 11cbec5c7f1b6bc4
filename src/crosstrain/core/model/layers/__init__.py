"""The neutral layer vocabulary: shapes are channels-last, weights are numpy.

Each layer knows its output shape (so a plan is checked end to end before any process
starts), the shapes of its weights and how each starts (Glorot-uniform kernels, zero
biases, unit scales, small normal embeddings), and its multiply-add count for
``crosstrain describe``. Every backend receives exactly the arrays made here (numpy,
channels-last, seeded). How layers connect (names, ``inputs``, blocks) lives in
:mod:`crosstrain.core.model.graph`.

Shapes here are one row's: the batch axis is never part of them.
"""

from __future__ import annotations

# each family module's layer types (its ``__all__``: importing the family fills LAYER_TYPES),
# and the types every layer module and plan reader uses, importable from here
from crosstrain.core.model.layers.activations import *  # noqa: F403
from crosstrain.core.model.layers.base import LAYER_TYPES as LAYER_TYPES
from crosstrain.core.model.layers.base import DType as DType
from crosstrain.core.model.layers.base import Layer as Layer
from crosstrain.core.model.layers.base import Pair as Pair
from crosstrain.core.model.layers.base import Shape as Shape
from crosstrain.core.model.layers.base import Weights as Weights
from crosstrain.core.model.layers.base import WeightSpec as WeightSpec
from crosstrain.core.model.layers.base import as_pair as as_pair
from crosstrain.core.model.layers.convolutions import *  # noqa: F403
from crosstrain.core.model.layers.dense import *  # noqa: F403
from crosstrain.core.model.layers.merges import *  # noqa: F403
from crosstrain.core.model.layers.norms import *  # noqa: F403
from crosstrain.core.model.layers.sequences import *  # noqa: F403
from crosstrain.core.model.layers.shapes import *  # noqa: F403

#: the base and every layer type, by the classes' own registry: what ``crosstrain``
#: re-exports (``from crosstrain import Dense``) at run time
__all__ = ["Layer", *(cls.__name__ for cls in LAYER_TYPES.values())]


def layer_name(layer: Layer, index: int) -> str:
    """The neutral name of a layer in its list: its own ``name``, else ``{type}_{index}``."""
    return layer.name or f"{layer.type}_{index}"
