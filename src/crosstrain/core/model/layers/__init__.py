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

from crosstrain.core.model.layers.activations import (
    GELU,
    HardSwish,
    LeakyReLU,
    ReLU,
    ReLU6,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
)

# the types every layer module and plan reader uses, importable from here as before the split
from crosstrain.core.model.layers.base import DType as DType
from crosstrain.core.model.layers.base import Layer
from crosstrain.core.model.layers.base import Pair as Pair
from crosstrain.core.model.layers.base import Shape as Shape
from crosstrain.core.model.layers.base import Weights as Weights
from crosstrain.core.model.layers.base import WeightSpec as WeightSpec
from crosstrain.core.model.layers.base import as_pair as as_pair
from crosstrain.core.model.layers.convolutions import (
    AvgPool2D,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    GlobalAvgPool2D,
    MaxPool2D,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.model.layers.dense import Dense, Dropout, LayerScale, Rescale
from crosstrain.core.model.layers.merges import Add, Block, Concat, Multiply
from crosstrain.core.model.layers.norms import BatchNorm, LayerNorm, RMSNorm
from crosstrain.core.model.layers.sequences import (
    Attention,
    ClassToken,
    Embedding,
    PaddingMask,
    PositionEmbedding,
)
from crosstrain.core.model.layers.shapes import Flatten, Mean, Reshape, Take, Transpose

#: every layer type by its plan tag: the vocabulary a plan's layers are checked against.
#: A new layer type is its class in its family's module, its class here and its name in ``__all__`` below;
#: each backend's ``LAYERS`` table then needs one row for it (a test fails until it has one).
LAYER_TYPES: dict[str, type[Layer]] = {
    cls.type: cls
    for cls in (
        Dense,
        Conv2D,
        MaxPool2D,
        AvgPool2D,
        GlobalAvgPool2D,
        Flatten,
        Conv1D,
        Conv2DTranspose,
        UpSample2D,
        ZeroPad2D,
        Crop2D,
        LayerScale,
        Sigmoid,
        SiLU,
        Softmax,
        ReLU6,
        HardSwish,
        Multiply,
        Reshape,
        Transpose,
        Mean,
        Rescale,
        ReLU,
        LeakyReLU,
        GELU,
        Tanh,
        Dropout,
        LayerNorm,
        BatchNorm,
        Embedding,
        PositionEmbedding,
        Attention,
        RMSNorm,
        ClassToken,
        Take,
        PaddingMask,
        Add,
        Concat,
        Block,
    )
}


#: what ``crosstrain`` re-exports from here (``from crosstrain import Dense``): the base and
#: every layer type, so ``crosstrain/__init__.py`` needs no line for a new one
__all__ = [
    "GELU",
    "Add",
    "Attention",
    "AvgPool2D",
    "BatchNorm",
    "Block",
    "ClassToken",
    "Concat",
    "Conv1D",
    "Conv2D",
    "Conv2DTranspose",
    "Crop2D",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "GlobalAvgPool2D",
    "HardSwish",
    "Layer",
    "LayerNorm",
    "LayerScale",
    "LeakyReLU",
    "MaxPool2D",
    "Mean",
    "Multiply",
    "PaddingMask",
    "PositionEmbedding",
    "RMSNorm",
    "ReLU",
    "ReLU6",
    "Rescale",
    "Reshape",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Take",
    "Tanh",
    "Transpose",
    "UpSample2D",
    "ZeroPad2D",
]


def layer_name(layer: Layer, index: int) -> str:
    """The neutral name of a layer in its list: its own ``name``, else ``{type}_{index}``."""
    return layer.name or f"{layer.type}_{index}"
