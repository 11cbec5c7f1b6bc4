"""One Keras layer per neutral layer type: one row of ``LAYERS`` each (:class:`NodeSpec`).

Keras is channels-last like the neutral layouts, so kernels travel as they are (Dense
[in, out], Conv2D [kh, kw, in, out]) and Flatten already flattens in NHWC order. Keras's
own layers serve where they compute what docs/layers.md specifies; batch norm, dropout,
embeddings and attention are written here, because the spec fixes what Keras leaves open
(statistics over real rows of every replica, hash-based masks, fp32 softmax).

A :class:`ContextLayer` (nodes.py) also receives the row mask, the rows' global positions
and the optimizer step (what batch norm and dropout need); the others take their input
alone. A row also says how ``crosstrain export --format keras`` writes its layer
(export.py). The layers written here live by family beside this table, as torch's node
modules do: dense.py (hashed dropout, layer scale, the tied dense), norms.py (batch norm,
RMS norm), sequences.py (embeddings, attention, class token, padding mask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Generic, Literal, TypeVar

import attrs
import keras
import tensorflow as tf

from crosstrain.backends.tf.dense import FeatureScale, HashDropout, TiedDense
from crosstrain.backends.tf.nodes import NodeOptions
from crosstrain.backends.tf.norms import NeutralBatchNorm, RootMeanSquareNorm
from crosstrain.backends.tf.sequences import (
    ClassTokenLayer,
    PaddingMaskLayer,
    PositionTable,
    SelfAttention,
    TokenEmbedding,
)
from crosstrain.core.errors import InputError
from crosstrain.core.model.graph import Node
from crosstrain.core.model.layers import (
    AvgPool2D,
    BatchNorm,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Dense,
    Dropout,
    Embedding,
    Layer,
    MaxPool2D,
    Mean,
)
from crosstrain.core.model.layers.sequences import ATTENTION_PROJECTIONS


def exact_gelu(x: Any) -> Any:
    """GELU with erf, as torch's default; Keras's op defaults to the tanh approximation."""
    return keras.activations.gelu(x, approximate=False)


class TakePosition(keras.layers.Layer):  # type: ignore[misc]
    """``x[:, index]``: one position of each row's first axis."""

    def __init__(self, index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index

    def call(self, inputs: Any) -> Any:
        return inputs[:, self.index]


# --------------------------------------------------------------------------- the tables


LayerT = TypeVar("LayerT", bound=Layer)
#: a Keras layer for training from its layer, its graph node and the plan's options
Builder = Callable[[LayerT, Node, NodeOptions], keras.layers.Layer]
#: a stock Keras layer for export from its layer and its graph node, in float32
StockBuilder = Callable[[LayerT, Node], keras.layers.Layer]
#: neutral param -> the Keras layer's attribute holding it (the same array layout on both sides)
Weights = Mapping[str, str]


@attrs.frozen
class Stock(Generic[LayerT]):
    """How ``crosstrain export --format keras`` writes a layer whose own Keras layer is not
    stock (or not what inference computes): the stock Keras layer that computes it in
    inference, and where its neutral weights go."""

    build: StockBuilder[LayerT]
    weights: Weights = attrs.field(factory=dict)


#: a row's ``export`` when the layer it builds is stock Keras: exported as built, in float32
AS_BUILT: Final = "as built"
#: the options export builds an ``AS_BUILT`` layer with
EXPORTED = NodeOptions(policy="float32", seed=0)


@attrs.frozen
class NodeSpec(Generic[LayerT]):
    """How one core layer type runs on tf: its Keras layer, where its neutral weights sit
    in it (empty: it has none), and how ``--format keras`` exports it: ``AS_BUILT``, a
    :class:`Stock` layer, or None (no stock equivalent: the export is refused naming it)."""

    build: Builder[LayerT]
    export: Stock[LayerT] | Literal["as built"] | None
    weights: Weights = attrs.field(factory=dict)

    def stock(self) -> Stock[LayerT] | None:
        """The stock layer export builds, or None."""
        if self.export != AS_BUILT:
            return self.export
        build = self.build
        return Stock(lambda layer, node: build(layer, node, EXPORTED), self.weights)


def _named(node: Node, options: NodeOptions) -> dict[str, Any]:
    """Keras accepts the neutral path (dots included) as a layer name: weights are
    ``{layer.name}.{variable.name}`` on both sides."""
    return {"name": node.path, "dtype": options.policy}


def _dense(layer: Dense, node: Node, options: NodeOptions) -> keras.layers.Layer:
    if node.tied_to is not None:
        return TiedDense(layer.units, layer.use_bias, **_named(node, options))
    return _stock_dense(layer, node, options)


def _stock_dense(layer: Dense, node: Node, options: NodeOptions = EXPORTED) -> keras.layers.Layer:
    """Keras's Dense; a tied dense exports as one, its kernel a copy of the table (export.py)."""
    return keras.layers.Dense(layer.units, use_bias=layer.use_bias, **_named(node, options))


def _conv2d(layer: Conv2D, node: Node, options: NodeOptions) -> keras.layers.Layer:
    # Keras pads 'same' as the spec (TensorFlow's rule), and its grouped kernel is the
    # neutral [kh, kw, in / groups, out]
    return keras.layers.Conv2D(
        layer.filters,
        layer.kernel_size,
        strides=layer.strides,
        padding=layer.padding,
        dilation_rate=layer.dilation,
        groups=layer.groups,
        use_bias=layer.use_bias,
        **_named(node, options),
    )


def _max_pool(layer: MaxPool2D, node: Node, options: NodeOptions) -> keras.layers.Layer:
    return keras.layers.MaxPooling2D(
        layer.pool_size, strides=layer.effective_strides, padding=layer.padding, **_named(node, options)
    )


def _avg_pool(layer: AvgPool2D, node: Node, options: NodeOptions) -> keras.layers.Layer:
    return keras.layers.AveragePooling2D(
        layer.pool_size, strides=layer.effective_strides, padding=layer.padding, **_named(node, options)
    )


def _conv1d(layer: Conv1D, node: Node, options: NodeOptions) -> keras.layers.Layer:
    return keras.layers.Conv1D(
        layer.filters,
        layer.kernel_size,
        strides=layer.strides,
        padding=layer.padding,
        dilation_rate=layer.dilation,
        groups=layer.groups,
        use_bias=layer.use_bias,
        **_named(node, options),
    )


def _conv2d_transpose(layer: Conv2DTranspose, node: Node, options: NodeOptions) -> keras.layers.Layer:
    # Keras's kernel is [kh, kw, out, in], the neutral layout, and its sizes are the spec's
    return keras.layers.Conv2DTranspose(
        layer.filters,
        layer.kernel_size,
        strides=layer.strides,
        padding=layer.padding,
        use_bias=layer.use_bias,
        **_named(node, options),
    )


class AxisMean(keras.layers.Layer):  # type: ignore[misc]
    """The mean over some of a row's axes (Keras has a layer for the spatial axes only)."""

    def __init__(self, axes: tuple[int, ...], keepdims: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.axes, self.keepdims = [axis + 1 for axis in axes], keepdims

    def call(self, inputs: Any) -> Any:
        return tf.reduce_mean(inputs, axis=self.axes, keepdims=self.keepdims)


def _mean(layer: Mean, node: Node, options: NodeOptions) -> keras.layers.Layer:
    return AxisMean(layer.resolved_axes(len(node.input_shape)), layer.keepdims, **_named(node, options))


#: a mean's axes (for a row's rank) that a stock global pooling layer averages
_POOLED_AXES: Final = {
    (3, (0, 1)): keras.layers.GlobalAveragePooling2D,
    (2, (0,)): keras.layers.GlobalAveragePooling1D,
}


def _stock_mean(layer: Mean, node: Node) -> keras.layers.Layer:
    """A mean over an image's height and width, or a sequence's length, is Keras's global
    average pooling; no stock layer averages other axes."""
    rank = len(node.input_shape)
    pooling = _POOLED_AXES.get((rank, layer.resolved_axes(rank)))
    if pooling is None:
        raise InputError(
            f"--format keras: {node.field} (mean over axes {list(layer.axes)} of {list(node.input_shape)}) "
            "has no stock Keras layer; --format torch exports every layer"
        )
    return pooling(keepdims=layer.keepdims, **_named(node, EXPORTED))


def _batch_norm(layer: BatchNorm, node: Node, options: NodeOptions) -> keras.layers.Layer:
    # the spec computes batch norm in fp32 whatever the precision (fp64: in float64)
    full = keras.DTypePolicy(options.policy).variable_dtype
    return NeutralBatchNorm(
        layer.momentum, layer.epsilon, layer.scale, layer.center, name=node.path, dtype=full
    )


def _stock_batch_norm(layer: BatchNorm, node: Node) -> keras.layers.Layer:
    return keras.layers.BatchNormalization(
        axis=-1,
        momentum=layer.momentum,
        epsilon=layer.epsilon,
        scale=layer.scale,
        center=layer.center,
        **_named(node, EXPORTED),
    )


def _dropout(layer: Dropout, node: Node, options: NodeOptions) -> keras.layers.Layer:
    return HashDropout(layer.rate, options.seed, node.index, layer.per_row, **_named(node, options))


def _stock_dropout(layer: Dropout, node: Node) -> keras.layers.Layer:
    return keras.layers.Dropout(layer.rate, **_named(node, EXPORTED))  # off in inference


def _embedding(layer: Embedding, node: Node, options: NodeOptions) -> keras.layers.Layer:
    return TokenEmbedding(layer.vocab_size, layer.units, **_named(node, options))


def _stock_embedding(layer: Embedding, node: Node) -> keras.layers.Layer:
    return keras.layers.Embedding(layer.vocab_size, layer.units, **_named(node, EXPORTED))


def _same(names: Iterable[str]) -> dict[str, str]:
    """Weights kept under their neutral names."""
    return {name: name for name in names}


def _keras(factory: Callable[..., keras.layers.Layer], *args: Any, **kwargs: Any) -> Builder[Layer]:
    """A builder for a layer whose Keras form needs nothing from the neutral layer."""
    return lambda layer, node, options: factory(*args, **kwargs, **_named(node, options))


_KERNEL = _same(("kernel", "bias"))
_BATCH_NORM = ("scale", "offset", "moving_mean", "moving_variance")

#: a layer type's tag -> how it runs here, one row each; core's graph resolves blocks, so
#: ``block`` has no row. The keys are the backend's vocabulary of layers.
LAYERS: dict[str, NodeSpec[Any]] = {
    "dense": NodeSpec(_dense, Stock(_stock_dense, _KERNEL), _KERNEL),
    "conv2d": NodeSpec(_conv2d, AS_BUILT, _KERNEL),
    "maxpool2d": NodeSpec(_max_pool, AS_BUILT),
    "avgpool2d": NodeSpec(_avg_pool, AS_BUILT),
    "global_avg_pool2d": NodeSpec(_keras(keras.layers.GlobalAveragePooling2D), AS_BUILT),
    # channels_last: NHWC order, as the neutral Flatten
    "flatten": NodeSpec(_keras(keras.layers.Flatten), AS_BUILT),
    "conv1d": NodeSpec(_conv1d, AS_BUILT, _KERNEL),
    "conv2d_transpose": NodeSpec(_conv2d_transpose, AS_BUILT, _KERNEL),
    "upsample2d": NodeSpec(  # bilinear: tf.image.resize's half-pixel centres
        lambda layer, node, options: keras.layers.UpSampling2D(
            layer.size, interpolation=layer.interpolation, **_named(node, options)
        ),
        AS_BUILT,
    ),
    "zero_pad2d": NodeSpec(
        lambda layer, node, options: keras.layers.ZeroPadding2D(layer.padding, **_named(node, options)),
        AS_BUILT,
    ),
    "crop2d": NodeSpec(
        lambda layer, node, options: keras.layers.Cropping2D(layer.cropping, **_named(node, options)),
        AS_BUILT,
    ),
    "layer_scale": NodeSpec(_keras(FeatureScale), None, _same(("scale",))),
    "sigmoid": NodeSpec(_keras(keras.layers.Activation, "sigmoid"), AS_BUILT),
    "silu": NodeSpec(_keras(keras.layers.Activation, "silu"), AS_BUILT),
    "softmax": NodeSpec(_keras(keras.layers.Softmax, axis=-1), AS_BUILT),
    "relu6": NodeSpec(_keras(keras.layers.Activation, "relu6"), AS_BUILT),  # gradient 0 at 0 and 6
    "hard_swish": NodeSpec(_keras(keras.layers.Activation, "hard_silu"), AS_BUILT),  # x * (relu6(x + 3) / 6)
    "multiply": NodeSpec(_keras(keras.layers.Multiply), AS_BUILT),  # left to right, broadcasting sizes of 1
    "reshape": NodeSpec(
        lambda layer, node, options: keras.layers.Reshape(node.output_shape, **_named(node, options)),
        AS_BUILT,
    ),
    "transpose": NodeSpec(  # Keras counts the batch axis as 0
        lambda layer, node, options: keras.layers.Permute(
            [axis + 1 for axis in layer.perm], **_named(node, options)
        ),
        AS_BUILT,
    ),
    "mean": NodeSpec(_mean, Stock(_stock_mean)),
    "rescale": NodeSpec(  # x * scale + offset, as Keras's Rescaling rounds it
        lambda layer, node, options: keras.layers.Rescaling(
            layer.scale, offset=layer.offset, **_named(node, options)
        ),
        AS_BUILT,
    ),
    "relu": NodeSpec(_keras(keras.layers.ReLU), AS_BUILT),  # gradient 0 at 0, as torch's
    "leaky_relu": NodeSpec(  # gradient negative_slope at 0, as torch's
        lambda layer, node, options: keras.layers.LeakyReLU(
            negative_slope=layer.negative_slope, **_named(node, options)
        ),
        AS_BUILT,
    ),
    "gelu": NodeSpec(
        _keras(keras.layers.Activation, exact_gelu),
        # a function of ours would need crosstrain to load; Keras's gelu activation is erf's by default
        Stock(lambda layer, node: keras.layers.Activation("gelu", **_named(node, EXPORTED))),
    ),
    "tanh": NodeSpec(_keras(keras.layers.Activation, "tanh"), AS_BUILT),
    "dropout": NodeSpec(_dropout, Stock(_stock_dropout)),
    "layernorm": NodeSpec(
        lambda layer, node, options: keras.layers.LayerNormalization(
            axis=-1, epsilon=layer.eps, **_named(node, options)
        ),
        AS_BUILT,
        {"scale": "gamma", "offset": "beta"},
    ),
    "batchnorm": NodeSpec(
        _batch_norm,
        Stock(_stock_batch_norm, {"scale": "gamma", "offset": "beta"} | _same(_BATCH_NORM[2:])),
        _same(_BATCH_NORM),
    ),
    "embedding": NodeSpec(_embedding, Stock(_stock_embedding, {"table": "embeddings"}), _same(("table",))),
    "position_embedding": NodeSpec(_keras(PositionTable), None, _same(("table",))),
    "attention": NodeSpec(
        lambda layer, node, options: SelfAttention(layer, *node.input_shape, **_named(node, options)),
        None,
        _same(
            f"{projection}_{param}" for projection in ATTENTION_PROJECTIONS for param in ("kernel", "bias")
        ),
    ),
    "rmsnorm": NodeSpec(
        lambda layer, node, options: RootMeanSquareNorm(layer.epsilon, **_named(node, options)),
        Stock(
            lambda layer, node: keras.layers.RMSNormalization(
                epsilon=layer.epsilon, **_named(node, EXPORTED)
            ),
            _same(("scale",)),
        ),
        _same(("scale",)),
    ),
    "class_token": NodeSpec(_keras(ClassTokenLayer), None, _same(("token",))),
    "take": NodeSpec(lambda layer, node, options: TakePosition(layer.index, **_named(node, options)), None),
    "padding_mask": NodeSpec(
        lambda layer, node, options: PaddingMaskLayer(layer.pad_id, **_named(node, options)), None
    ),
    "add": NodeSpec(_keras(keras.layers.Add), AS_BUILT),  # sums left to right
    "concat": NodeSpec(_keras(keras.layers.Concatenate, axis=-1), AS_BUILT),
}
