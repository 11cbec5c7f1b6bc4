"""The table of the layer types this backend speaks (``LAYERS``), and the nodes of the
convolution, pooling, shape, activation and merge families; the dense family's, the
normalisations' and the sequences' are in dense.py, norms.py and sequences.py. jax is
channels-last like the neutral layout: images stay NHWC, a Conv2D kernel [kh, kw, in, out]
is XLA's HWIO, Flatten is a plain reshape. What each computes is specified in docs/layers.md."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from crosstrain import (
    AvgPool2D,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    LeakyReLU,
    MaxPool2D,
    Mean,
    Node,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from jax import lax

from crosstrain_jax.dense import build_dense, build_dropout, build_layer_scale, build_rescale
from crosstrain_jax.nodes import Apply, Builder, Env, elementwise, layer_of, single
from crosstrain_jax.norms import build_batchnorm, build_layernorm, build_rmsnorm
from crosstrain_jax.sequences import (
    build_attention,
    build_class_token,
    build_embedding,
    build_padding_mask,
    build_position_embedding,
    build_take,
)

# --------------------------------------------------------------------------- convolution


def _conv2d(node: Node) -> Apply:
    layer = layer_of(node, Conv2D)
    padding = layer.paddings(node.input_shape)  # TensorFlow's 'same' (XLA's SAME is the same)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        y = lax.conv_general_dilated(
            single(inputs),
            env.param(f"{node.path}.kernel"),
            window_strides=layer.strides,
            padding=padding,
            rhs_dilation=layer.dilation,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=layer.groups,
            precision=env.compute.matmul,
        )
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


# --------------------------------------------------------------------------- pooling, reshaping


def _window(
    node: Node, layer: MaxPool2D | AvgPool2D
) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, int]]]:
    """NHWC reduce_window's window, strides and padding: the pool slides over height and
    width only; 'same' pads as TensorFlow (the extra row or column after)."""
    size, stride = layer.pool_size, layer.effective_strides
    (top, bottom), (left, right) = layer.paddings(node.input_shape)
    padding = [(0, 0), (top, bottom), (left, right), (0, 0)]
    return (1, size, size, 1), (1, stride, stride, 1), padding


def _maxpool2d(node: Node) -> Apply:
    window, strides, padding = _window(node, layer_of(node, MaxPool2D))

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # padded with the init value -inf: padding never wins
        pooled: jax.Array = lax.reduce_window(
            single(inputs), -jnp.inf, lax.max, window, strides, padding
        )
        return pooled

    return apply


def _avgpool2d(node: Node) -> Apply:
    layer = layer_of(node, AvgPool2D)
    window, strides, padding = _window(node, layer)
    # the real cells each window covers ('valid': the window's size everywhere)
    counts = layer.real_counts(node.input_shape)[None, :, :, None]

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = single(inputs)
        # a concrete (numpy) zero: only then does jax see a sum it can differentiate
        summed: jax.Array = lax.reduce_window(
            x, np.zeros((), x.dtype), lax.add, window, strides, padding
        )
        return summed / counts.astype(x.dtype)  # the window's sum, then one division (as torch)

    return apply


def _global_avg_pool2d(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return single(inputs).mean(axis=(1, 2))

    return apply


def _flatten(node: Node) -> Apply:
    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = single(inputs)
        return x.reshape(x.shape[0], -1)  # already channels-last: the neutral order

    return apply


# --------------------------------------------------------------------------- vision and shapes


def _conv1d(node: Node) -> Apply:
    layer = layer_of(node, Conv1D)
    padding = (layer.paddings(node.input_shape),)

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        y = lax.conv_general_dilated(
            single(inputs),
            env.param(f"{node.path}.kernel"),
            window_strides=(layer.strides,),
            padding=padding,
            rhs_dilation=(layer.dilation,),
            dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=layer.groups,
            precision=env.compute.matmul,
        )
        return y + env.param(f"{node.path}.bias") if layer.use_bias else y

    return apply


def _conv2d_transpose(node: Node) -> Apply:
    """The whole transposed convolution (a convolution of the input dilated by the strides,
    padded kernel - 1 each side, with the kernel flipped: ``transpose_kernel``), then the
    layer's part of it (``crops``) and its zeros after the end, as padding of that convolution."""
    layer = layer_of(node, Conv2DTranspose)
    # the whole is kernel - 1 padding each side of the dilated input; start later, end where
    # the output does (zeros past the whole's end come from padding too)
    padding = [
        (window - 1 - start, output - 1 - (size - 1) * stride + start)
        for (start, _), window, stride, size, output in zip(
            layer.crops(node.input_shape),
            layer.kernel_size,
            layer.strides,
            node.input_shape,
            node.output_shape,
            strict=False,
        )
    ]

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        # the neutral [kh, kw, out, in] is lax's HWIO of the convolution this transposes
        y = lax.conv_transpose(
            single(inputs),
            env.param(f"{node.path}.kernel"),
            layer.strides,
            padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            transpose_kernel=True,
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
    layer = layer_of(node, UpSample2D)
    bilinear = layer.interpolation == "bilinear"

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        x = _upsample_axis(single(inputs), 1, layer.size[0], bilinear)
        return _upsample_axis(x, 2, layer.size[1], bilinear).astype(inputs[0].dtype)

    return apply


def _zero_pad2d(node: Node) -> Apply:
    rows, columns = layer_of(node, ZeroPad2D).padding

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return jnp.pad(single(inputs), ((0, 0), rows, columns, (0, 0)))

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
        x = single(inputs)
        return x.reshape(x.shape[0], *shape)

    return apply


def _transpose(node: Node) -> Apply:
    order = (0, *(axis + 1 for axis in layer_of(node, Transpose).perm))
    return elementwise(lambda x: jnp.transpose(x, order))(node)


def _mean(node: Node) -> Apply:
    layer = layer_of(node, Mean)
    axes = tuple(axis + 1 for axis in layer.resolved_axes(len(node.input_shape)))
    return elementwise(lambda x: x.mean(axis=axes, keepdims=layer.keepdims))(node)


# --------------------------------------------------------------------------- activations


def _relu(x: jax.Array) -> jax.Array:
    # gradient 0 at 0, as torch's (jnp.maximum splits it); NaN stays NaN, as in torch, so a
    # corrupt row shows in the loss instead of poisoning the weights silently
    return jnp.where(x <= 0, 0, x)


def _leaky_relu(node: Node) -> Apply:
    slope = layer_of(node, LeakyReLU).negative_slope
    # not jax.nn.leaky_relu, whose gradient at 0 is 1: the spec's (torch's) is the slope
    return elementwise(lambda x: jnp.where(x > 0, x, slope * x))(node)


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # the exact (erf) form


def _crop2d(node: Node) -> Apply:
    (top, bottom), (left, right) = layer_of(node, Crop2D).cropping
    height, width, _ = node.input_shape

    def apply(env: Env, inputs: Sequence[jax.Array]) -> jax.Array:
        return single(inputs)[:, top : height - bottom, left : width - right]

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
LAYERS: dict[str, Builder] = {
    "dense": build_dense,
    "conv2d": _conv2d,
    "maxpool2d": _maxpool2d,
    "avgpool2d": _avgpool2d,
    "global_avg_pool2d": _global_avg_pool2d,
    "flatten": _flatten,
    "conv1d": _conv1d,
    "conv2d_transpose": _conv2d_transpose,
    "upsample2d": _upsample2d,
    "zero_pad2d": _zero_pad2d,
    "crop2d": _crop2d,
    "layer_scale": build_layer_scale,
    "sigmoid": elementwise(jax.nn.sigmoid),
    "silu": elementwise(jax.nn.silu),
    "softmax": elementwise(_softmax),
    "relu6": elementwise(_relu6),
    "hard_swish": elementwise(_hard_swish),
    "multiply": _multiply,
    "reshape": _reshape,
    "transpose": _transpose,
    "mean": _mean,
    "rescale": build_rescale,
    "relu": elementwise(_relu),
    "leaky_relu": _leaky_relu,
    "gelu": elementwise(_gelu),
    "tanh": elementwise(jnp.tanh),
    "dropout": build_dropout,
    "layernorm": build_layernorm,
    "batchnorm": build_batchnorm,
    "embedding": build_embedding,
    "position_embedding": build_position_embedding,
    "attention": build_attention,
    "rmsnorm": build_rmsnorm,
    "class_token": build_class_token,
    "take": build_take,
    "padding_mask": build_padding_mask,
    "add": _add,
    "concat": _concat,
}
