"""The plan's model graph as a pure jax.numpy function, the losses, and the compiled steps.

Every name this backend speaks is a key of a table here (:data:`LAYERS`, :data:`LOSSES`,
:data:`PRECISIONS`) or in :mod:`crosstrain_jax.optimizer` (``OPTIMIZERS``); the keys are
the backend's vocabulary, which crosstrain checks a plan against before launch. There is
no fallback: a name outside the tables never reaches this module.

jax is channels-last like the neutral layout, so nothing is converted at the edge:
weights keep their neutral names (``{node.path}.{param}``) and shapes (Dense kernel
[in, out], Conv2D kernel [kh, kw, in, out] = XLA's HWIO), images stay NHWC, and Flatten
is a plain reshape. What each layer computes is docs/layers.md's spec.

The batch axis of every array is sharded over the devices, and every expression below
is written over the *global* batch: a sum over rows (the loss, batch norm's statistics)
is already a sum over all replicas; XLA inserts the all-reduce.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import (
    GELU,
    MODEL_INPUT,
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
    Node,
    PaddingMask,
    Plan,
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
    decayed_weights,
    dropout,
    rotary_tables,
)
from jax import lax

from crosstrain_jax.optimizer import OptimizerState, Tree, apply_update, clip_by_global_norm

Params = Mapping[str, jax.Array]
#: what the accumulation scan carries: (summed gradients, moving statistics so far)
Carry = tuple[Tree, Tree]
LayerT = TypeVar("LayerT", bound=Layer)


# --------------------------------------------------------------------------- precisions


@attrs.frozen
class Compute:
    """How the forward pass computes: the activations' dtype and the matmul precision; and
    ``full``, the weights' dtype (crosstrain's ``WEIGHT_DTYPES``), in which the outputs, the
    loss, the normalisations and attention's softmax are computed whatever the precision.
    Weights are masters in ``full``, cast where they are used."""

    dtype: np.dtype[Any]
    matmul: lax.Precision
    full: np.dtype[Any]


#: the precisions this backend speaks. fp16 is absent on purpose: it needs a loss scaler,
#: which this example leaves out, and its absence from the vocabulary refuses it before launch.
#: fp64 needs jax's 64-bit mode, which building an fp64 plan switches on (:func:`use_x64`).
PRECISIONS: dict[str, Compute] = {
    # HIGHEST: GPUs would otherwise run fp32 matmuls in TF32 and lose parity
    "fp32": Compute(np.dtype(np.float32), lax.Precision.HIGHEST, np.dtype(np.float32)),
    "bf16": Compute(np.dtype(jnp.bfloat16), lax.Precision.DEFAULT, np.dtype(np.float32)),
    "fp64": Compute(np.dtype(np.float64), lax.Precision.HIGHEST, np.dtype(np.float64)),
}


def use_x64(plan: Plan) -> None:
    """Switch on jax's 64-bit mode for this process when ``plan`` trains in float64 (jax
    otherwise makes every float64 array float32). The mode is process-wide: the worker is a
    process of its own, and code written for 32 bits here names its dtypes, so a float32
    plan built later in the same process still computes in float32."""
    wide = PRECISIONS[plan.train.precision].full.itemsize == 8
    if wide and not jax.config.read("jax_enable_x64"):  # type: ignore[no-untyped-call]
        jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- the forward pass


@attrs.frozen
class TrainInputs:
    """What only a training forward needs: dropout's counters and batch norm's row weights."""

    step: jax.Array  # uint32 scalar: StepBatch.step
    rows: jax.Array  # uint32 [batch]: Batch.rows, each row's place in the global batch
    weight: jax.Array  # float32 [batch]: 1 for a real row, 0 for padding


# a pytree, so that a compiled function can take it as one argument
jax.tree_util.register_pytree_node(
    TrainInputs,
    lambda inputs: ((inputs.step, inputs.rows, inputs.weight), None),
    lambda _, children: TrainInputs(*children),
)


@attrs.frozen
class Env:
    """One call of the forward pass. ``train`` is None in evaluation. Layers that update
    non-trainable weights (batch norm's moving statistics) write the new values into
    ``updates``; the training step carries them to the next micro-batch."""

    weights: Params
    compute: Compute
    seed: int
    train: TrainInputs | None
    updates: dict[str, jax.Array] = attrs.field(factory=dict)
    #: a tied dense node's index -> the name of its embedding's table
    tied_tables: Mapping[int, str] = attrs.field(factory=dict)

    def param(self, name: str) -> jax.Array:
        # bf16 runs cast the float32 master weights here; the gradient flows back in float32.
        return self.weights[name].astype(self.compute.dtype)


#: a built layer: (env, input values in ``node.inputs`` order) -> output value
Apply = Callable[[Env, Sequence[jax.Array]], jax.Array]
#: a table entry: the node (layer, shapes, weight prefix, the embedding a dense is tied
#: to) -> its Apply
Builder = Callable[[Node], Apply]
#: forward(weights, x, train) -> (outputs in the weights' dtype, updated non-trainable weights)
Forward = Callable[[Params, jax.Array, TrainInputs | None], tuple[jax.Array, dict[str, jax.Array]]]


def build_forward(plan: Plan) -> Forward:
    """The plan's model graph as one function; every node is built by its type's LAYERS entry."""
    graph = plan.model.graph(plan.source)
    compute = PRECISIONS[plan.train.precision]
    steps = [(node, LAYERS[type(node.layer)](node)) for node in graph.nodes]
    float_input = graph.input_dtype == "float32"  # token ids stay int32 for the embedding
    tied = {node.index: table for node in graph.nodes
            if (table := graph.tied_table(node)) is not None}

    def forward(
        weights: Params, x: jax.Array, train: TrainInputs | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        env = Env(weights, compute, plan.seed, train, tied_tables=tied)
        values = {MODEL_INPUT: x.astype(compute.dtype) if float_input else x}
        for node, apply in steps:
            values[node.index] = apply(env, [values[source] for source in node.inputs])
        return values[graph.output].astype(compute.full), env.updates

    return forward


def _layer(node: Node, kind: type[LayerT]) -> LayerT:
    """The node's layer as its concrete type (LAYERS dispatches on it, so this holds)."""
    layer = node.layer
    assert isinstance(layer, kind)
    return layer


def _single(inputs: Sequence[jax.Array]) -> jax.Array:
    (x,) = inputs
    return x


# --------------------------------------------------------------------------- dense and conv


def _dense(node: Node) -> Apply:
    layer = _layer(node, Dense)

    def kernel(env: Env) -> jax.Array:
        if node.tied_to is None:
            return env.param(f"{node.path}.kernel")
        # tied: the embedding's table [vocab, units], transposed; its gradient sums both uses
        return env.param(env.tied_tables[node.index]).T

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # matmul contracts the last axis of any rank: [batch, ..., in] @ [in, out]
        y = jnp.matmul(_single(inputs), kernel(env), precision=env.compute.matmul)
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


def _conv2d(node: Node) -> Apply:
    layer = _layer(node, Conv2D)
    padding = layer.paddings(node.input_shape)  # TensorFlow's 'same' (XLA's SAME is the same)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        y = lax.conv_general_dilated(
            _single(inputs), env.param(f"{node.path}.kernel"),
            window_strides=layer.strides, padding=padding, rhs_dilation=layer.dilation,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=layer.groups,
            precision=env.compute.matmul,
        )
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


# --------------------------------------------------------------------------- pooling, reshaping


def _window(node: Node, layer: MaxPool2D | AvgPool2D) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                 list[tuple[int, int]]]:
    """NHWC reduce_window's window, strides and padding: the pool slides over height and
    width only; 'same' pads as TensorFlow (the extra row or column after)."""
    size, stride = layer.pool_size, layer.effective_strides
    (top, bottom), (left, right) = layer.paddings(node.input_shape)
    padding = [(0, 0), (top, bottom), (left, right), (0, 0)]
    return (1, size, size, 1), (1, stride, stride, 1), padding


def _maxpool2d(node: Node) -> Apply:
    window, strides, padding = _window(node, _layer(node, MaxPool2D))

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # padded with the init value -inf: padding never wins
        pooled: jax.Array = lax.reduce_window(_single(inputs), -jnp.inf, lax.max, window,
                                              strides, padding)
        return pooled

    return apply


def _avgpool2d(node: Node) -> Apply:
    layer = _layer(node, AvgPool2D)
    window, strides, padding = _window(node, layer)
    # the real cells each window covers ('valid': the window's size everywhere)
    counts = layer.real_counts(node.input_shape)[None, :, :, None]

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        # a concrete (numpy) zero: only then does jax see a sum it can differentiate
        summed: jax.Array = lax.reduce_window(x, np.zeros((), x.dtype), lax.add, window,
                                              strides, padding)
        return summed / counts.astype(x.dtype)  # the window's sum, then one division (as torch)

    return apply


def _global_avg_pool2d(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return _single(inputs).mean(axis=(1, 2))

    return apply


def _flatten(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        return x.reshape(x.shape[0], -1)  # already channels-last: the neutral order

    return apply


# --------------------------------------------------------------------------- vision and shapes


def _conv1d(node: Node) -> Apply:
    layer = _layer(node, Conv1D)
    padding = (layer.paddings(node.input_shape),)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        y = lax.conv_general_dilated(
            _single(inputs), env.param(f"{node.path}.kernel"),
            window_strides=(layer.strides,), padding=padding, rhs_dilation=(layer.dilation,),
            dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=layer.groups,
            precision=env.compute.matmul,
        )
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


def _conv2d_transpose(node: Node) -> Apply:
    """The whole transposed convolution (a convolution of the input dilated by the strides,
    padded kernel - 1 each side, with the kernel flipped: ``transpose_kernel``), then the
    layer's part of it (``crops``) and its zeros after the end, as padding of that convolution."""
    layer = _layer(node, Conv2DTranspose)
    # the whole is kernel - 1 padding each side of the dilated input; start later, end where
    # the output does (zeros past the whole's end come from padding too)
    padding = [
        (window - 1 - start, output - 1 - (size - 1) * stride + start)
        for (start, _), window, stride, size, output in zip(
            layer.crops(node.input_shape), layer.kernel_size, layer.strides, node.input_shape,
            node.output_shape, strict=False)
    ]

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # the neutral [kh, kw, out, in] is lax's HWIO of the convolution this transposes
        y = lax.conv_transpose(
            _single(inputs), env.param(f"{node.path}.kernel"), layer.strides, padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), transpose_kernel=True,
            precision=env.compute.matmul,
        )
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


def _upsample_axis(x: jax.Array, axis: int, size: int, bilinear: bool) -> jax.Array:
    """One axis ``size`` times longer: repeated, or read at half-pixel centres (position o
    at (o + 0.5) / size - 0.5, clamped at 0) between its two neighbours."""
    length = x.shape[axis]
    if not bilinear:
        return jnp.repeat(x, size, axis=axis)
    source = np.maximum((np.arange(length * size) + 0.5) / size - 0.5, 0.0)
    low = np.floor(source).astype(np.int32)
    high = np.minimum(low + 1, length - 1)
    shape = [1] * x.ndim
    shape[axis] = length * size
    # the weights in float32 at least (as torch's kernels), in the input's dtype if wider
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    far = jnp.asarray((source - low).reshape(shape), dtype)
    near = jnp.asarray((1.0 - (source - low)).reshape(shape), dtype)
    return near * jnp.take(x, low, axis=axis) + far * jnp.take(x, high, axis=axis)


def _upsample2d(node: Node) -> Apply:
    layer = _layer(node, UpSample2D)
    bilinear = layer.interpolation == "bilinear"

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _upsample_axis(_single(inputs), 1, layer.size[0], bilinear)
        return _upsample_axis(x, 2, layer.size[1], bilinear).astype(inputs[0].dtype)

    return apply


def _zero_pad2d(node: Node) -> Apply:
    rows, columns = _layer(node, ZeroPad2D).padding

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return jnp.pad(_single(inputs), ((0, 0), rows, columns, (0, 0)))

    return apply


def _relu6(x: jax.Array) -> jax.Array:
    # gradient 0 at 0 and at 6, as torch's and tf's (jnp.clip would split it at the ties)
    return jnp.where(x <= 0, 0, jnp.where(x >= 6, 6, x)).astype(x.dtype)


def _hard_swish(x: jax.Array) -> jax.Array:
    return x * (_relu6(x + 3) / 6)  # Keras's hard_silu, differentiated as written


def _softmax(x: jax.Array) -> jax.Array:
    return jax.nn.softmax(x, axis=-1)


def _multiply(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return functools.reduce(jnp.multiply, inputs)  # left to right, broadcasting sizes of 1

    return apply


def _reshape(node: Node) -> Apply:
    shape = node.output_shape

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        return x.reshape(x.shape[0], *shape)

    return apply


def _transpose(node: Node) -> Apply:
    order = (0, *(axis + 1 for axis in _layer(node, Transpose).perm))
    return _elementwise(lambda x: jnp.transpose(x, order))(node)


def _mean(node: Node) -> Apply:
    layer = _layer(node, Mean)
    axes = tuple(axis + 1 for axis in layer.resolved_axes(len(node.input_shape)))
    return _elementwise(lambda x: x.mean(axis=axes, keepdims=layer.keepdims))(node)


def _rescale(node: Node) -> Apply:
    layer = _layer(node, Rescale)
    # a vector (per channel of the last axis) in the input's dtype, as Keras casts it
    scale, offset = np.asarray(layer.scale, np.float32), np.asarray(layer.offset, np.float32)
    if not layer.per_channel:
        return _elementwise(lambda x: x * layer.scale + layer.offset)(node)
    return _elementwise(lambda x: x * scale.astype(x.dtype) + offset.astype(x.dtype))(node)


# --------------------------------------------------------------------------- activations


def _elementwise(function: Callable[[jax.Array], jax.Array]) -> Builder:
    def build(node: Node) -> Apply:
        def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
            return function(_single(inputs))

        return apply

    return build


def _relu(x: jax.Array) -> jax.Array:
    # gradient 0 at 0, as torch's (jnp.maximum splits it); NaN stays NaN, as in torch, so a
    # corrupt row shows in the loss instead of poisoning the weights silently
    return jnp.where(x <= 0, 0, x)


def _leaky_relu(node: Node) -> Apply:
    slope = _layer(node, LeakyReLU).negative_slope
    # not jax.nn.leaky_relu, whose gradient at 0 is 1: the spec's (torch's) is the slope
    return _elementwise(lambda x: jnp.where(x > 0, x, slope * x))(node)


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # the exact (erf) form


# --------------------------------------------------------------------------- dropout


def _mix(value: jax.Array) -> jax.Array:
    """crosstrain.dropout.mix in uint32: a uint32 multiply wraps around, which is the
    reference's ``(value * c) & 0xFFFFFFFF``; shifts of unsigned values are logical."""
    value = value ^ (value >> 16)
    value = value * np.uint32(dropout.MULTIPLIERS[0])
    value = value ^ (value >> 15)
    value = value * np.uint32(dropout.MULTIPLIERS[1])
    return value ^ (value >> 16)


def keep_mask(
    seed: int, step: jax.Array, layer: int, rows: jax.Array, features: int, rate: float
) -> jax.Array:
    """bool [len(rows), features], bit for bit crosstrain.dropout.keep_mask; ``step``
    and ``rows`` are uint32 (the host masks them to 32 bits), so a new step recompiles
    nothing."""
    state = _mix(jnp.asarray(np.uint32(seed & dropout.MASK32)))
    state = _mix(state ^ step.astype(jnp.uint32))
    state = _mix(state ^ np.uint32(layer & dropout.MASK32))
    per_row = _mix(state ^ rows.astype(jnp.uint32)[:, None])
    hashed = _mix(per_row ^ jnp.arange(features, dtype=jnp.uint32)[None, :])
    return (hashed >> (32 - dropout.KEEP_BITS)) >= np.uint32(dropout.threshold(rate))


def _dropout(node: Node) -> Apply:
    layer = _layer(node, Dropout)
    rate, features = layer.rate, layer.mask_units(node.input_shape)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        if env.train is None or rate == 0.0:
            return x
        keep = keep_mask(env.seed, env.train.step, node.index, env.train.rows, features, rate)
        # (x * keep) * (1 / (1 - rate)), in that order, as the spec rounds it
        shape = (x.shape[0],) + (1,) * (x.ndim - 1) if layer.per_row else x.shape
        return (x * keep.reshape(shape).astype(x.dtype)) * (1.0 / (1.0 - rate))

    return apply


# --------------------------------------------------------------------------- normalisation


def _layernorm(node: Node) -> Apply:
    eps = _layer(node, LayerNorm).eps

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        """Over the last axis, in float32 even in bf16 runs (as torch's autocast does)."""
        x = _single(inputs)
        x32 = x.astype(env.compute.full)
        mean = x32.mean(axis=-1, keepdims=True)
        variance = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
        normed = (x32 - mean) * lax.rsqrt(variance + eps)
        scale, offset = env.weights[f"{node.path}.scale"], env.weights[f"{node.path}.offset"]
        return (normed * scale + offset).astype(x.dtype)

    return apply


def batch_moments(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per feature of the last axis, over the real rows (weight 1) and every other axis:
    (n, mean, biased variance), two passes. ``x`` holds the global batch (sharded), so these
    sums are already across every replica."""
    row_weight = weight.reshape(-1, *([1] * (x.ndim - 1)))
    axes = tuple(range(x.ndim - 1))
    n = weight.sum() * math.prod(x.shape[1:-1])
    # An all-padding micro-batch (n = 0) would divide 0 by 0 and poison the gradient with
    # NaN even at weight 0; dividing by 1 instead leaves its zero sums zero.
    divisor = jnp.maximum(n, 1.0)
    mean = (row_weight * x).sum(axis=axes) / divisor
    variance = (row_weight * jnp.square(x - mean)).sum(axis=axes) / divisor
    return n, mean, variance


def _batchnorm(node: Node) -> Apply:
    layer = _layer(node, BatchNorm)
    names = {param: f"{node.path}.{param}"
             for param in ("scale", "offset", "moving_mean", "moving_variance")}

    def moved(old: jax.Array, batch: jax.Array, n: jax.Array) -> jax.Array:
        # A micro-batch of padding only (the tail of an epoch's last step) has no statistics
        # to contribute: it leaves the moving ones as they were.
        new = layer.momentum * old + (1 - layer.momentum) * lax.stop_gradient(batch)
        return jnp.where(n > 0, new, old)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        x32 = x.astype(env.compute.full)  # computed in fp32 whatever the precision (fp64: float64)
        if env.train is None:
            mean = env.weights[names["moving_mean"]]
            variance = env.weights[names["moving_variance"]]
        else:
            n, mean, variance = batch_moments(x32, env.train.weight)
            # n / (n - 1), with n - 1 clamped at 1 as torch does (one value: variance 0)
            unbiased = variance * n / jnp.maximum(n - 1, 1.0)
            env.updates[names["moving_mean"]] = moved(env.weights[names["moving_mean"]], mean, n)
            env.updates[names["moving_variance"]] = moved(
                env.weights[names["moving_variance"]], unbiased, n)
        normed = (x32 - mean) / jnp.sqrt(variance + layer.epsilon)
        # scale and offset absent under Keras's scale=False / center=False
        y = normed * env.weights[names["scale"]] if layer.scale else normed
        y = y + env.weights[names["offset"]] if layer.center else y
        return y.astype(x.dtype)

    return apply


# --------------------------------------------------------------------------- sequences


def _embedding(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # int32 ids [batch, length] -> [batch, length, units]; the gradient scatter-adds
        return jnp.take(env.param(f"{node.path}.table"), _single(inputs), axis=0)

    return apply


def _position_embedding(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return _single(inputs) + env.param(f"{node.path}.table")  # broadcast over the batch

    return apply


def _attention(node: Node) -> Apply:
    layer = _layer(node, Attention)
    length, units = node.input_shape
    heads, head_units = layer.heads, units // layer.heads
    groups = heads // layer.key_heads
    # True where query position i may see key position j
    visible = np.tril(np.ones((length, length), bool)) if layer.causal else None
    cos, sin = rotary_tables(length, head_units, layer.rotary_base)  # [length, head units]

    def rotate(value: jax.Array) -> jax.Array:
        """[batch, length, heads, head units] turned by the tables (the half-split pairs)."""
        half = head_units // 2
        turned = jnp.concatenate([-value[..., half:], value[..., :half]], axis=-1)
        return (value * cos[:, None, :].astype(value.dtype)
                + turned * sin[:, None, :].astype(value.dtype))

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = inputs[0]

        def project(name: str, value: jax.Array) -> jax.Array:
            kernel = env.param(f"{node.path}.{name}_kernel")
            y = jnp.matmul(value, kernel, precision=env.compute.matmul)
            return y + env.param(f"{node.path}.{name}_bias") if layer.use_bias else y

        def split(value: jax.Array) -> jax.Array:  # head h takes units h*d .. h*d+d
            return value.reshape(x.shape[0], length, -1, head_units)

        query, key, value = (split(project(name, x)) for name in ("query", "key", "value"))
        if layer.rotary:
            query, key = rotate(query), rotate(key)
        if groups > 1:  # key/value head j serves query heads j*groups .. j*groups+groups-1
            key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=env.compute.matmul,
                            preferred_element_type=env.compute.full) / math.sqrt(head_units)
        if len(inputs) > 1:  # the padding mask: -1e9 on a padded key's scores
            scores = scores + ((inputs[1].astype(env.compute.full) - 1) * 1e9)[:, None, None, :]
        if visible is not None:
            scores = jnp.where(visible, scores, -jnp.inf)
        probabilities = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # softmax in fp32
        joined = jnp.einsum("bhqk,bkhd->bqhd", probabilities, value,
                            precision=env.compute.matmul).reshape(x.shape)
        return project("output", joined)

    return apply


def _rmsnorm(node: Node) -> Apply:
    epsilon = _layer(node, RMSNorm).epsilon

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        """Over the last axis, in float32 even in bf16 runs (as layer norm)."""
        x = _single(inputs)
        x32 = x.astype(env.compute.full)
        normed = x32 * lax.rsqrt(jnp.square(x32).mean(axis=-1, keepdims=True) + epsilon)
        return (normed * env.weights[f"{node.path}.scale"]).astype(x.dtype)

    return apply


def _crop2d(node: Node) -> Apply:
    (top, bottom), (left, right) = _layer(node, Crop2D).cropping
    height, width, _ = node.input_shape

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return _single(inputs)[:, top : height - bottom, left : width - right]

    return apply


def _layer_scale(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        return x * env.param(f"{node.path}.scale").astype(x.dtype)

    return apply


def _class_token(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _single(inputs)
        token = env.param(f"{node.path}.token").astype(x.dtype)  # [1, units]
        return jnp.concatenate([jnp.broadcast_to(token, (x.shape[0], *token.shape)), x], axis=1)

    return apply


def _take(node: Node) -> Apply:
    index = _layer(node, Take).index

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return _single(inputs)[:, index]

    return apply


def _padding_mask(node: Node) -> Apply:
    pad_id = _layer(node, PaddingMask).pad_id

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return (_single(inputs) != pad_id).astype(env.compute.dtype)

    return apply


# --------------------------------------------------------------------------- merges


def _add(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return functools.reduce(jnp.add, inputs)  # left to right, as the spec rounds it

    return apply


def _concat(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return jnp.concatenate(list(inputs), axis=-1)

    return apply


#: the layer types this backend speaks: their ``type`` names are its vocabulary's layers.
#: ``block`` is absent because core resolves blocks into these nodes before a backend builds.
LAYERS: dict[type[Layer], Builder] = {
    Dense: _dense,
    Conv2D: _conv2d,
    MaxPool2D: _maxpool2d,
    AvgPool2D: _avgpool2d,
    GlobalAvgPool2D: _global_avg_pool2d,
    Flatten: _flatten,
    Conv1D: _conv1d,
    Conv2DTranspose: _conv2d_transpose,
    UpSample2D: _upsample2d,
    ZeroPad2D: _zero_pad2d,
    Crop2D: _crop2d,
    LayerScale: _layer_scale,
    Sigmoid: _elementwise(jax.nn.sigmoid),
    SiLU: _elementwise(jax.nn.silu),
    Softmax: _elementwise(_softmax),
    ReLU6: _elementwise(_relu6),
    HardSwish: _elementwise(_hard_swish),
    Multiply: _multiply,
    Reshape: _reshape,
    Transpose: _transpose,
    Mean: _mean,
    Rescale: _rescale,
    ReLU: _elementwise(_relu),
    LeakyReLU: _leaky_relu,
    GELU: _elementwise(_gelu),
    Tanh: _elementwise(jnp.tanh),
    Dropout: _dropout,
    LayerNorm: _layernorm,
    BatchNorm: _batchnorm,
    Embedding: _embedding,
    PositionEmbedding: _position_embedding,
    Attention: _attention,
    RMSNorm: _rmsnorm,
    ClassToken: _class_token,
    Take: _take,
    PaddingMask: _padding_mask,
    Add: _add,
    Concat: _concat,
}


# --------------------------------------------------------------------------- losses


@attrs.frozen
class Loss:
    """One loss: each row's loss (in the outputs' dtype: the weights';
    ``row_loss(outputs, targets, label_smoothing)``), its targets' dtype, and how many target
    positions a row's targets hold."""

    row_loss: Callable[[jax.Array, jax.Array, float], jax.Array]
    target_dtype: np.dtype[Any]
    targets_per_row: Callable[[tuple[int, ...]], int]


def _rows(values: jax.Array) -> jax.Array:
    """Sum each row's values over every axis but the batch axis."""
    return values.reshape(values.shape[0], -1).sum(axis=1)


def _cross_entropy(
    logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0
) -> jax.Array:
    """Logits [batch, ..., classes], targets [batch, ...]: the SUM over a row's positions;
    label smoothing e: (1 - e) x the label's negative log-probability plus e x the classes'
    mean one (torch's formula). Float targets [batch, 3] are a mixed row's (label, partner's
    label, lam) (mixup, cutmix): lam x the loss of the label + (1 - lam) x the partner's."""
    if jnp.issubdtype(targets.dtype, jnp.floating):
        own = _cross_entropy(logits, targets[:, 0].astype(jnp.int32), label_smoothing)
        partner = _cross_entropy(logits, targets[:, 1].astype(jnp.int32), label_smoothing)
        lam = targets[:, 2].astype(own.dtype)
        return lam * own + (1 - lam) * partner
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    if label_smoothing:
        picked = (1 - label_smoothing) * picked + label_smoothing * log_probs.mean(axis=-1)
    return -_rows(picked)


def _mse(outputs: jax.Array, targets: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """The mean over a row's output elements."""
    return jnp.square(outputs - targets).reshape(outputs.shape[0], -1).mean(axis=1)


def _binary_cross_entropy(
    logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0
) -> jax.Array:
    """Each output's sigmoid cross-entropy with its float target (tf's stable form
    max(x, 0) - x t + log(1 + exp(-|x|))), the mean over a row's outputs."""
    targets = targets.reshape(logits.shape)
    each = jnp.maximum(logits, 0) - logits * targets + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    return each.reshape(logits.shape[0], -1).mean(axis=1)


#: the losses this backend speaks: the keys are its vocabulary's losses
LOSSES: dict[str, Loss] = {
    # jax runs 32-bit by default: class ids as int32 (vocabularies far below 2**31)
    "cross_entropy": Loss(_cross_entropy, np.dtype(np.int32), lambda shape: math.prod(shape[1:])),
    # a regression or multi-label row counts once, whatever its number of outputs
    "mse": Loss(_mse, np.dtype(np.float32), lambda shape: 1),
    "binary_cross_entropy": Loss(_binary_cross_entropy, np.dtype(np.float32), lambda shape: 1),
}


def _correct(logits: jax.Array, targets: jax.Array, plan: Plan) -> jax.Array:
    """How many of a row's positions have the target as their argmax."""
    return _rows((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))


def _top_k_correct(logits: jax.Array, targets: jax.Array, plan: Plan) -> jax.Array:
    """How many of a row's positions have fewer than ``top_k`` logits above the target's
    (a tie counts for the target)."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    return _rows(((logits > target).sum(axis=-1) < plan.top_k).astype(jnp.float32))


#: the metrics this backend counts in its eval step -> (the sum's name, each row's hits): the
#: keys are its vocabulary's metrics
METRIC_COUNTS: dict[str, tuple[str, Callable[[jax.Array, jax.Array, Plan], jax.Array]]] = {
    "accuracy": ("correct", _correct),
    "top_k_accuracy": ("top_k_correct", _top_k_correct),
}


def parameter_count(params: Params) -> int:
    return sum(int(value.size) for value in params.values())


# --------------------------------------------------------------------------- compiled steps


def make_train_step(plan: Plan, forward: Forward, trainable: Sequence[str]) -> Callable[..., Any]:
    """train_step(params, buffers, optimizer_state, xs, ys, ws, rows, scale, scalars, step)
    -> (params, buffers, optimizer_state, micro_sums), to be jitted.

    ``params`` are the trainable weights (what the gradient, clipping and the optimizer
    see), ``buffers`` the others (batch norm's moving statistics, updated by each
    micro-batch's forward pass in order). ``xs``/``ys``/``ws``/``rows`` stack the step's
    micro-batches on axis 0; their batch axis is sharded over the devices, so XLA sums each
    gradient across devices (each micro-batch loss is sum(weight * row loss)
    * ``scale``, scale = 1 / global real target positions).
    """
    loss, spec, clip = LOSSES[plan.loss.name], plan.optimizer, plan.train.clip_grad_norm
    smoothing = plan.loss.label_smoothing
    decayed = decayed_weights(plan.model.graph().weight_specs(), spec.decay)

    def micro_loss(
        params: Params, buffers: Params, x: jax.Array, y: jax.Array, train: TrainInputs,
        scale: jax.Array,
    ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
        outputs, updates = forward({**params, **buffers}, x, train)
        micro_sum = (loss.row_loss(outputs, y, smoothing) * train.weight).sum()
        return micro_sum * scale, (micro_sum, updates)

    gradient = jax.grad(micro_loss, has_aux=True)

    def train_step(
        params: Tree, buffers: Tree, optimizer_state: OptimizerState, xs: jax.Array,
        ys: jax.Array, ws: jax.Array, rows: jax.Array, scale: jax.Array,
        scalars: Mapping[str, jax.Array], step: jax.Array,
    ) -> tuple[Tree, Tree, OptimizerState, jax.Array]:
        def accumulate(carry: Carry, micro: tuple[jax.Array, ...]) -> tuple[Carry, jax.Array]:
            total, moving = carry
            x, y, weight, row = micro
            grads, (micro_sum, updates) = gradient(
                params, moving, x, y, TrainInputs(step, row, weight), scale)
            summed = {name: total[name] + grads[name] for name in total}
            return (summed, {**moving, **updates}), micro_sum

        zeros = {name: jnp.zeros_like(value) for name, value in params.items()}
        (grads, buffers), micro_sums = lax.scan(accumulate, (zeros, buffers), (xs, ys, ws, rows))
        if clip is not None:
            grads = clip_by_global_norm(grads, trainable, clip)
        new_params, new_state = apply_update(spec, params, grads, optimizer_state, scalars, decayed)
        return new_params, buffers, new_state, micro_sums

    return train_step


def make_eval_step(
    plan: Plan, forward: Forward
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """eval_step(weights, x, y) -> (per-row loss, {sum name: per-row hits} of each counted
    metric of the plan), to be jitted. The host sums them in float64, in row order, so the
    totals do not depend on the device count."""
    loss = LOSSES[plan.loss.name]
    counted = [METRIC_COUNTS[metric] for metric in plan.metrics if metric in METRIC_COUNTS]

    def eval_step(
        weights: Params, x: jax.Array, y: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        outputs, _ = forward(weights, x, None)
        losses = loss.row_loss(outputs, y, plan.loss.label_smoothing)
        return losses, {name: hits(outputs, y, plan) for name, hits in counted}

    return eval_step
