"""One Keras layer per neutral layer type: one row of ``LAYERS`` each (:class:`NodeSpec`).

Keras is channels-last like the neutral layouts, so kernels travel as they are (Dense
[in, out], Conv2D [kh, kw, in, out]) and Flatten already flattens in NHWC order. Keras's
own layers serve where they compute what docs/layers.md specifies; batch norm, dropout,
embeddings and attention are written here, because the spec fixes what Keras leaves open
(statistics over real rows of every replica, hash-based masks, fp32 softmax).

A :class:`ContextLayer` also receives the row mask, the rows' global positions and the
optimizer step (what batch norm and dropout need); the others take their input alone. A
row also says how ``crosstrain export --format keras`` writes its layer (export.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Generic, Literal, TypeVar

import attrs
import keras
import tensorflow as tf

from crosstrain.core import dropout as neutral_dropout
from crosstrain.core.errors import InputError
from crosstrain.core.graph import Node
from crosstrain.core.layers import (
    GELU,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    ClassToken,
    Concat,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    HardSwish,
    Layer,
    LayerNorm,
    LayerScale,
    LeakyReLU,
    MaxPool2D,
    Mean,
    Multiply,
    PaddingMask,
    PositionEmbedding,
    ReLU,
    ReLU6,
    Rescale,
    Reshape,
    RMSNorm,
    Sigmoid,
    SiLU,
    Softmax,
    Take,
    Tanh,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.layers.sequences import ATTENTION_PROJECTIONS, rotary_tables


@attrs.frozen
class NodeOptions:
    """What every builder gets besides the layer and its node: the Keras dtype policy's
    name and the plan's seed (dropout hashes it)."""

    policy: str
    seed: int


def exact_gelu(x: Any) -> Any:
    """GELU with erf, as torch's default; Keras's op defaults to the tanh approximation."""
    return keras.activations.gelu(x, approximate=False)


class ContextLayer(keras.layers.Layer):  # type: ignore[misc]
    """A layer whose training forward needs more than its input: ``weight`` (float row
    mask, 1 real / 0 padding), ``rows`` (int64 positions in the step's global batch) and
    ``step`` (int64 optimizer step). Without them every row is real, rows count from 0
    and the step is 0."""

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        raise NotImplementedError


# --------------------------------------------------------------------------- batch norm


def sum_across_replicas(tensor: Any) -> Any:
    """The sum over every replica of every process, differentiable (the gradient of an
    all-reduced sum is the all-reduced sum of the gradients); the identity at world 1."""
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensor)


class NeutralBatchNorm(ContextLayer):
    """docs/layers.md's batch norm, in fp32 (built with the float32 policy; float64 under fp64).

    The moving statistics are non-trainable variables updated in the forward pass. Every
    replica computes the same global statistics; ``ONLY_FIRST_REPLICA`` makes each update
    write replica 0's value to every copy, so the copies stay identical bit for bit."""

    def __init__(
        self, momentum: float, epsilon: float, scale: bool = True, center: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.momentum, self.epsilon = momentum, epsilon
        self.has_scale, self.has_offset = scale, center

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        features = (int(input_shape[-1]),)  # type: ignore[arg-type]
        # absent under Keras's scale=False / center=False
        self.scale = (
            self.add_weight(shape=features, initializer="ones", name="scale") if self.has_scale else None
        )
        self.offset = (
            self.add_weight(shape=features, initializer="zeros", name="offset") if self.has_offset else None
        )
        self.moving_mean = self._statistic(features, "zeros", "moving_mean")
        self.moving_variance = self._statistic(features, "ones", "moving_variance")

    def _statistic(self, shape: tuple[int], initializer: str, name: str) -> Any:
        return self.add_weight(
            shape=shape,
            initializer=initializer,
            trainable=False,
            autocast=False,
            aggregation="only_first_replica",
            name=name,
        )

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        x = tf.cast(inputs, self.variable_dtype)
        if training:
            mean, variance = self._batch_statistics(x, weight)
        else:
            mean, variance = self.moving_mean, self.moving_variance
        y = (x - mean) / tf.sqrt(variance + self.epsilon)
        if self.scale is not None:
            y = y * self.scale
        if self.offset is not None:
            y = y + self.offset
        return y

    def _batch_statistics(self, x: Any, weight: Any) -> tuple[Any, Any]:
        """Two all-reduced passes over the real rows: the mean, then the biased variance."""
        rank = len(x.shape)
        axes = list(range(rank - 1))
        row_weight = tf.ones(tf.shape(x)[:1], x.dtype) if weight is None else tf.cast(weight, x.dtype)
        broadcast = tf.reshape(row_weight, [-1] + [1] * (rank - 1))
        positions = math.prod(x.shape[1:-1])
        count = tf.reduce_sum(row_weight) * positions
        first = sum_across_replicas(tf.concat([tf.reduce_sum(x * broadcast, axes), count[None]], 0))
        count = tf.stop_gradient(first[-1])
        # a micro-batch of padding alone (the end of an epoch) has no statistics: divide by
        # 1 instead of 0 so nothing turns NaN, and leave the moving statistics alone
        divisor = tf.maximum(count, 1.0)
        mean = first[:-1] / divisor
        variance = sum_across_replicas(tf.reduce_sum(tf.square(x - mean) * broadcast, axes)) / divisor
        self._update_moving(tf.stop_gradient(mean), tf.stop_gradient(variance), count)
        return mean, variance

    def _update_moving(self, mean: Any, variance: Any, count: Any) -> None:
        unbiased = variance * (count / tf.maximum(count - 1.0, 1.0))
        real = count > 0.0
        for variable, batch in ((self.moving_mean, mean), (self.moving_variance, unbiased)):
            moved = self.momentum * variable + (1.0 - self.momentum) * batch
            variable.assign(tf.where(real, moved, variable))


# --------------------------------------------------------------------------- dropout


def _mix(value: Any) -> Any:
    """crosstrain.core.dropout.mix in TensorFlow's int64 ops (products stay below 2**63)."""
    first, second = neutral_dropout.MULTIPLIERS
    mask = tf.constant(neutral_dropout.MASK32, tf.int64)
    value = tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(16, tf.int64)))
    value = tf.bitwise.bitwise_and(value * first, mask)
    value = tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(15, tf.int64)))
    value = tf.bitwise.bitwise_and(value * second, mask)
    return tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(16, tf.int64)))


def keep_mask(seed: int, step: Any, layer: int, rows: Any, features: int, rate: float) -> Any:
    """bool [rows, features], bit for bit :func:`crosstrain.core.dropout.keep_mask`."""
    mask = tf.constant(neutral_dropout.MASK32, tf.int64)
    step = tf.bitwise.bitwise_and(tf.cast(step, tf.int64), mask)
    state = _mix(tf.constant(seed & neutral_dropout.MASK32, tf.int64))
    state = _mix(tf.bitwise.bitwise_xor(state, step))
    state = _mix(tf.bitwise.bitwise_xor(state, tf.constant(layer & neutral_dropout.MASK32, tf.int64)))
    per_row = _mix(
        tf.bitwise.bitwise_xor(state, tf.bitwise.bitwise_and(tf.cast(rows, tf.int64), mask)[:, None])
    )
    hashed = _mix(tf.bitwise.bitwise_xor(per_row, tf.range(features, dtype=tf.int64)[None, :]))
    top = tf.bitwise.right_shift(hashed, tf.constant(32 - neutral_dropout.KEEP_BITS, tf.int64))
    return top >= neutral_dropout.threshold(rate)


class HashDropout(ContextLayer):
    """Dropout whose mask hashes (seed, step, node index, global row, feature): the same
    units drop in every framework and at every world size, with no generator state."""

    def __init__(
        self, rate: float, seed: int, layer_index: int, per_row: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.rate, self.seed, self.layer_index, self.per_row = rate, seed, layer_index, per_row

    def call(
        self, inputs: Any, training: bool = False, weight: Any = None, rows: Any = None, step: Any = None
    ) -> Any:
        if not training or self.rate == 0.0:
            return inputs
        rows = tf.range(tf.shape(inputs)[0], dtype=tf.int64) if rows is None else rows
        step = tf.zeros((), tf.int64) if step is None else step
        # per row: one unit a row, broadcast over the row's values
        features = 1 if self.per_row else math.prod(inputs.shape[1:])
        keep = keep_mask(self.seed, step, self.layer_index, rows, features, self.rate)
        shape = [-1] + [1] * (len(inputs.shape) - 1) if self.per_row else tf.shape(inputs)
        keep = tf.cast(tf.reshape(keep, shape), inputs.dtype)
        return (inputs * keep) * (1.0 / (1.0 - self.rate))


# --------------------------------------------------------------------------- sequences


class TokenEmbedding(keras.layers.Layer):  # type: ignore[misc]
    """``table[ids]``; the table's gradient comes back as IndexedSlices."""

    def __init__(self, vocab_size: int, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.units = vocab_size, units

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.table = self.add_weight(shape=(self.vocab_size, self.units), initializer="zeros", name="table")

    def call(self, inputs: Any) -> Any:
        return tf.cast(tf.gather(self.table, tf.cast(inputs, tf.int32)), self.compute_dtype)


class PositionTable(keras.layers.Layer):  # type: ignore[misc]
    """``x + table``, the table [length, units] broadcast over the batch."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="zeros", name="table")

    def call(self, inputs: Any) -> Any:
        return inputs + tf.cast(self.table, inputs.dtype)


class SelfAttention(keras.layers.Layer):  # type: ignore[misc]
    """Multi-head self-attention as docs/layers.md writes it: projections in the compute
    dtype, scores scaled by 1/sqrt(head units) and softmaxed in fp32 (the variables' dtype:
    float64 under fp64), later positions masked when causal. Grouped keys and values
    (``kv_heads``) serve ``heads / kv_heads`` consecutive query heads each; ``rotary`` turns
    queries and keys by core's tables; a second input, the padding mask [batch, length],
    adds -1e9 to padded keys' scores."""

    def __init__(self, layer: Attention, length: int, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads, self.causal, self.use_bias = layer.heads, layer.causal, layer.use_bias
        self.depth = units // layer.heads
        self.groups = layer.heads // layer.key_heads
        self.rotary = (
            tuple(tf.constant(table) for table in rotary_tables(length, self.depth, layer.rotary_base))
            if layer.rotary
            else None
        )

    def build(self, input_shape: Any) -> None:
        shape = input_shape[0] if isinstance(input_shape, list) else input_shape
        units = int(shape[-1])
        key_units = self.depth * (self.heads // self.groups)
        for projection in ATTENTION_PROJECTIONS:
            width = key_units if projection in ("key", "value") else units
            kernel = self.add_weight(shape=(units, width), initializer="zeros", name=f"{projection}_kernel")
            setattr(self, f"{projection}_kernel", kernel)
            if self.use_bias:
                bias = self.add_weight(shape=(width,), initializer="zeros", name=f"{projection}_bias")
                setattr(self, f"{projection}_bias", bias)

    def _project(self, x: Any, projection: str) -> Any:
        kernel = tf.cast(getattr(self, f"{projection}_kernel"), self.compute_dtype)
        projected = tf.matmul(x, kernel)
        if not self.use_bias:
            return projected
        return projected + tf.cast(getattr(self, f"{projection}_bias"), self.compute_dtype)

    def _rotate(self, x: Any) -> Any:
        """x [batch, heads, length, depth] turned by the rotary tables (half-split)."""
        assert self.rotary is not None
        cos, sin = (tf.cast(table, x.dtype) for table in self.rotary)
        half = self.depth // 2
        turned = tf.concat([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + turned * sin

    def call(self, inputs: Any) -> Any:
        x, padding = (inputs[0], inputs[1]) if isinstance(inputs, list | tuple) else (inputs, None)
        length, units = int(x.shape[1]), int(x.shape[2])

        def split(projection: str) -> Any:  # [batch, length, units] -> [batch, heads, length, depth]
            projected = self._project(x, projection)
            heads = int(projected.shape[-1]) // self.depth
            return tf.transpose(tf.reshape(projected, [-1, length, heads, self.depth]), [0, 2, 1, 3])

        query, key, value = split("query"), split("key"), split("value")
        if self.rotary is not None:
            query, key = self._rotate(query), self._rotate(key)
        if self.groups > 1:
            key, value = tf.repeat(key, self.groups, axis=1), tf.repeat(value, self.groups, axis=1)
        full = self.variable_dtype
        scores = tf.cast(tf.matmul(query, key, transpose_b=True), full) / math.sqrt(self.depth)
        if padding is not None:
            scores = scores + ((tf.cast(padding, full) - 1.0) * 1e9)[:, None, None, :]
        if self.causal:
            allowed = tf.linalg.band_part(tf.ones((length, length), tf.bool), -1, 0)
            scores = tf.where(allowed, scores, tf.constant(-math.inf, full))
        weights = tf.cast(tf.nn.softmax(scores, axis=-1), self.compute_dtype)
        attended = tf.transpose(tf.matmul(weights, value), [0, 2, 1, 3])
        return self._project(tf.reshape(attended, [-1, length, units]), "output")


class RootMeanSquareNorm(keras.layers.Layer):  # type: ignore[misc]
    """docs/layers.md's RMS norm of the last axis, in the variables' dtype (fp32 under bf16 and
    fp16, float64 under fp64) whatever the compute dtype."""

    def __init__(self, epsilon: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.scale = self.add_weight(shape=(int(input_shape[-1]),), initializer="ones", name="scale")  # type: ignore[arg-type]

    def call(self, inputs: Any) -> Any:
        x = tf.cast(inputs, self.variable_dtype)
        normed = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + self.epsilon)
        return tf.cast(normed * self.scale, self.compute_dtype)


class FeatureScale(keras.layers.Layer):  # type: ignore[misc]
    """``x * scale`` over the last axis, as Keras's LayerScale computes it (the scale in the
    compute dtype)."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.scale = self.add_weight(shape=(int(input_shape[-1]),), initializer="ones", name="scale")  # type: ignore[arg-type]

    def call(self, inputs: Any) -> Any:
        return inputs * tf.cast(self.scale, inputs.dtype)


class ClassTokenLayer(keras.layers.Layer):  # type: ignore[misc]
    """The learned token [1, units] before each row's sequence."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.token = self.add_weight(shape=(1, int(input_shape[-1])), initializer="zeros", name="token")  # type: ignore[arg-type]

    def call(self, inputs: Any) -> Any:
        token = tf.cast(self.token, inputs.dtype)[None]  # [1, 1, units]
        return tf.concat([tf.tile(token, [tf.shape(inputs)[0], 1, 1]), inputs], axis=1)


class TakePosition(keras.layers.Layer):  # type: ignore[misc]
    """``x[:, index]``: one position of each row's first axis."""

    def __init__(self, index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index

    def call(self, inputs: Any) -> Any:
        return inputs[:, self.index]


class TiedDense(keras.layers.Layer):  # type: ignore[misc]
    """A dense whose kernel is an embedding's table transposed (``tie``): the graph model
    hands it that embedding (:meth:`tie`); its own variable is the bias alone."""

    def __init__(self, units: int, use_bias: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units, self.use_bias = units, use_bias
        self.table: Callable[[], Any] = _untied

    def tie(self, embedding: keras.layers.Layer) -> None:
        # read through a function: an attribute holding the layer would make Keras track the
        # embedding, and its table, a second time
        self.table = lambda: embedding.table

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if self.use_bias:
            self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, inputs: Any) -> Any:
        outputs = tf.matmul(inputs, tf.cast(self.table(), self.compute_dtype), transpose_b=True)
        return outputs + tf.cast(self.bias, self.compute_dtype) if self.use_bias else outputs


def _untied() -> Any:
    raise RuntimeError("a tied dense runs after GraphModel.tie hands it its embedding")


class PaddingMaskLayer(keras.layers.Layer):  # type: ignore[misc]
    """Token ids -> 1 (a real token) or 0 (``pad_id``), in the compute dtype."""

    def __init__(self, pad_id: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pad_id = pad_id

    def call(self, inputs: Any) -> Any:
        return tf.cast(tf.not_equal(inputs, self.pad_id), self.compute_dtype)


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

#: core layer type -> how it runs here, one row each; core's graph resolves blocks, so
#: Block has no row. The keys are the backend's vocabulary of layers.
LAYERS: dict[type[Layer], NodeSpec[Any]] = {
    Dense: NodeSpec(_dense, Stock(_stock_dense, _KERNEL), _KERNEL),
    Conv2D: NodeSpec(_conv2d, AS_BUILT, _KERNEL),
    MaxPool2D: NodeSpec(_max_pool, AS_BUILT),
    AvgPool2D: NodeSpec(_avg_pool, AS_BUILT),
    GlobalAvgPool2D: NodeSpec(_keras(keras.layers.GlobalAveragePooling2D), AS_BUILT),
    # channels_last: NHWC order, as the neutral Flatten
    Flatten: NodeSpec(_keras(keras.layers.Flatten), AS_BUILT),
    Conv1D: NodeSpec(_conv1d, AS_BUILT, _KERNEL),
    Conv2DTranspose: NodeSpec(_conv2d_transpose, AS_BUILT, _KERNEL),
    UpSample2D: NodeSpec(  # bilinear: tf.image.resize's half-pixel centres
        lambda layer, node, options: keras.layers.UpSampling2D(
            layer.size, interpolation=layer.interpolation, **_named(node, options)
        ),
        AS_BUILT,
    ),
    ZeroPad2D: NodeSpec(
        lambda layer, node, options: keras.layers.ZeroPadding2D(layer.padding, **_named(node, options)),
        AS_BUILT,
    ),
    Crop2D: NodeSpec(
        lambda layer, node, options: keras.layers.Cropping2D(layer.cropping, **_named(node, options)),
        AS_BUILT,
    ),
    LayerScale: NodeSpec(_keras(FeatureScale), None, _same(("scale",))),
    Sigmoid: NodeSpec(_keras(keras.layers.Activation, "sigmoid"), AS_BUILT),
    SiLU: NodeSpec(_keras(keras.layers.Activation, "silu"), AS_BUILT),
    Softmax: NodeSpec(_keras(keras.layers.Softmax, axis=-1), AS_BUILT),
    ReLU6: NodeSpec(_keras(keras.layers.Activation, "relu6"), AS_BUILT),  # gradient 0 at 0 and 6
    HardSwish: NodeSpec(_keras(keras.layers.Activation, "hard_silu"), AS_BUILT),  # x * (relu6(x + 3) / 6)
    Multiply: NodeSpec(_keras(keras.layers.Multiply), AS_BUILT),  # left to right, broadcasting sizes of 1
    Reshape: NodeSpec(
        lambda layer, node, options: keras.layers.Reshape(node.output_shape, **_named(node, options)),
        AS_BUILT,
    ),
    Transpose: NodeSpec(  # Keras counts the batch axis as 0
        lambda layer, node, options: keras.layers.Permute(
            [axis + 1 for axis in layer.perm], **_named(node, options)
        ),
        AS_BUILT,
    ),
    Mean: NodeSpec(_mean, Stock(_stock_mean)),
    Rescale: NodeSpec(  # x * scale + offset, as Keras's Rescaling rounds it
        lambda layer, node, options: keras.layers.Rescaling(
            layer.scale, offset=layer.offset, **_named(node, options)
        ),
        AS_BUILT,
    ),
    ReLU: NodeSpec(_keras(keras.layers.ReLU), AS_BUILT),  # gradient 0 at 0, as torch's
    LeakyReLU: NodeSpec(  # gradient negative_slope at 0, as torch's
        lambda layer, node, options: keras.layers.LeakyReLU(
            negative_slope=layer.negative_slope, **_named(node, options)
        ),
        AS_BUILT,
    ),
    GELU: NodeSpec(
        _keras(keras.layers.Activation, exact_gelu),
        # a function of ours would need crosstrain to load; Keras's gelu activation is erf's by default
        Stock(lambda layer, node: keras.layers.Activation("gelu", **_named(node, EXPORTED))),
    ),
    Tanh: NodeSpec(_keras(keras.layers.Activation, "tanh"), AS_BUILT),
    Dropout: NodeSpec(_dropout, Stock(_stock_dropout)),
    LayerNorm: NodeSpec(
        lambda layer, node, options: keras.layers.LayerNormalization(
            axis=-1, epsilon=layer.eps, **_named(node, options)
        ),
        AS_BUILT,
        {"scale": "gamma", "offset": "beta"},
    ),
    BatchNorm: NodeSpec(
        _batch_norm,
        Stock(_stock_batch_norm, {"scale": "gamma", "offset": "beta"} | _same(_BATCH_NORM[2:])),
        _same(_BATCH_NORM),
    ),
    Embedding: NodeSpec(_embedding, Stock(_stock_embedding, {"table": "embeddings"}), _same(("table",))),
    PositionEmbedding: NodeSpec(_keras(PositionTable), None, _same(("table",))),
    Attention: NodeSpec(
        lambda layer, node, options: SelfAttention(layer, *node.input_shape, **_named(node, options)),
        None,
        _same(
            f"{projection}_{param}" for projection in ATTENTION_PROJECTIONS for param in ("kernel", "bias")
        ),
    ),
    RMSNorm: NodeSpec(
        lambda layer, node, options: RootMeanSquareNorm(layer.epsilon, **_named(node, options)),
        Stock(
            lambda layer, node: keras.layers.RMSNormalization(
                epsilon=layer.epsilon, **_named(node, EXPORTED)
            ),
            _same(("scale",)),
        ),
        _same(("scale",)),
    ),
    ClassToken: NodeSpec(_keras(ClassTokenLayer), None, _same(("token",))),
    Take: NodeSpec(lambda layer, node, options: TakePosition(layer.index, **_named(node, options)), None),
    PaddingMask: NodeSpec(
        lambda layer, node, options: PaddingMaskLayer(layer.pad_id, **_named(node, options)), None
    ),
    Add: NodeSpec(_keras(keras.layers.Add), AS_BUILT),  # sums left to right
    Concat: NodeSpec(_keras(keras.layers.Concatenate, axis=-1), AS_BUILT),
}
