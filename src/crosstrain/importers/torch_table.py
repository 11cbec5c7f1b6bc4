"""Converters of the torch importer, part two (activations, arithmetic, normalisation,
sequences), and the table of every converter by module class, function or method:
:data:`CONVERTERS`, with :data:`NO_EQUIVALENT`, the reasons for what is known not to import.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.core.model import layers as neutral
from crosstrain.core.model.layers import (
    GELU,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Dropout,
    Embedding,
    Layer,
    LayerNorm,
    LeakyReLU,
    MaxPool2D,
    Multiply,
    PositionEmbedding,
    Rescale,
    Softmax,
)
from crosstrain.importers.common import Conversion, Piece, Weights
from crosstrain.importers.torch_converters import (
    _adaptive_avg_pool,
    _channels_first,
    _concat,
    _conv1d,
    _conv2d,
    _conv_transpose2d,
    _flatten_call,
    _flatten_module,
    _linear,
    _linear_reading_order,
    _mean_call,
    _module,
    _module_weights,
    _neutral,
    _pool,
    _size,
    _take,
    _view,
)
from crosstrain.importers.torch_steps import Converter, Step


def _fixed(layer: Layer) -> Callable[[Step], Conversion]:
    return lambda step: (Piece(layer),)


def _gelu(approximate: Callable[[Step], str]) -> Callable[[Step], Conversion]:
    def convert(step: Step) -> Conversion:
        step.option("approximate", approximate(step), "none", "the plan's gelu is the exact (erf) one")
        return (Piece(GELU()),)

    return convert


def _leaky_relu(step: Step) -> Conversion:
    return (Piece(LeakyReLU(negative_slope=float(_module(step).negative_slope))),)


def _softmax(dim: Callable[[Step], Any]) -> Callable[[Step], Conversion]:
    def convert(step: Step) -> Conversion:
        value = dim(step)
        rank = len(step.inputs[0].shape)
        if value is None or step.plan_axis(value) != rank - 2:
            raise step.refuse(
                f"dim={value}: the plan's softmax is over channels (the last axis channels-last)"
            )
        return (Piece(Softmax()),)

    return convert


def _dropout(step: Step) -> Conversion:
    return (Piece(Dropout(rate=float(_module(step).p))),)


def _identity(step: Step) -> Conversion:
    return ()


def _no_layers(step: Step) -> Conversion:
    """For a converter whose node gives sizes, not a tensor (:attr:`Converter.sizes`)."""
    return ()


def _arithmetic(op: str) -> Callable[[Step], Conversion]:
    """``a + b``, ``a * b`` of two tensors (add, multiply; a learned parameter added to a
    sequence is a position embedding); ``x + c``, ``x * c`` with a number (rescale)."""

    def convert(step: Step) -> Conversion:
        if step.kwargs.get("alpha", 1) != 1:
            raise step.refuse(f"alpha={step.kwargs['alpha']!r}: the plan adds the tensors as they are")
        parameters = [argument for argument in step.arguments if isinstance(argument, torch.Tensor)]
        numbers = [argument for argument in step.arguments if isinstance(argument, int | float)]
        if op == "add" and len(step.inputs) == 1 and len(parameters) == 1:
            return _position_embedding(step, parameters[0])
        if len(step.inputs) == 2 and not parameters and not numbers:
            return (Piece(Add() if op == "add" else Multiply()),)
        if len(step.inputs) == 1 and len(numbers) == 1 and not parameters:
            value = float(numbers[0])
            return (Piece(Rescale(scale=1.0, offset=value) if op == "add" else Rescale(scale=value)),)
        raise step.refuse(
            f"{op} of {len(step.inputs)} tensors, {len(parameters)} parameters and {numbers}: the plan takes "
            f"two tensors, a tensor and a number, or a sequence and a learned position table"
        )

    return convert


def _position_embedding(step: Step, table: torch.Tensor) -> Conversion:
    """A parameter [1, length, units] (or [length, units]) added to a sequence of that shape."""
    row = step.inputs[0].shape[1:]
    values = table.detach().to("cpu", torch.float32)
    if values.ndim == len(row) + 1 and values.shape[0] == 1:
        values = values[0]
    if len(row) != 2 or tuple(values.shape) != tuple(row):
        raise step.refuse(
            f"adds a parameter of shape {list(table.shape)} to rows of {list(row)}: the plan adds a learned "
            f"table only as a position embedding of a sequence's shape"
        )
    return (Piece(PositionEmbedding(), {"table": _neutral(PositionEmbedding, "table", values)}),)


def _getitem(step: Step) -> Conversion:
    """Item 0 of MultiheadAttention's (output, weights): its output; ``x[:, i]`` of a
    sequence: a take."""
    if not step.inputs:
        raise step.refuse("indexes no tensor")
    if not step.inputs[0].is_pair:
        return _take(step)
    if step.constants != (0,):
        raise step.refuse(
            "reads MultiheadAttention's attention weights: the plan's attention gives its output only"
        )
    return ()


def _batchnorm(step: Step) -> Conversion:
    norm = _module(step)
    step.option("affine", norm.affine, True, "the plan's batchnorm trains its scale and offset")
    step.option(
        "track_running_stats", norm.track_running_stats, True, "the plan's batchnorm keeps moving statistics"
    )
    if norm.momentum is None:
        raise step.refuse(
            "momentum=None (a cumulative average): the plan's moving statistics are exponential"
        )
    names = {
        "scale": "weight",
        "offset": "bias",
        "moving_mean": "running_mean",
        "moving_variance": "running_var",
    }
    # torch's momentum weighs the new batch; the plan's (Keras's) weighs the old statistics
    layer = BatchNorm(momentum=1.0 - float(norm.momentum), epsilon=float(norm.eps))
    piece = Piece(layer, _module_weights(BatchNorm, norm, names))
    # [batch, C, L]: torch normalises axis 1, the plan's batchnorm the last axis
    return _channels_first(piece) if len(step.inputs[0].shape) == 3 else (piece,)


def _layernorm(step: Step) -> Conversion:
    norm = _module(step)
    value = step.inputs[0]
    if value.image or tuple(norm.normalized_shape) != value.shape[-1:]:
        raise step.refuse(
            f"normalized_shape={list(norm.normalized_shape)} on {list(value.shape[1:])}: "
            f"the plan's layernorm "
            f"normalises the last axis of a sequence or vector"
        )
    step.option(
        "elementwise_affine",
        norm.elementwise_affine,
        True,
        "the plan's layernorm trains its scale and offset",
    )
    if norm.bias is None:
        raise step.refuse("bias=False: the plan's layernorm has an offset")
    weights = _module_weights(LayerNorm, norm, {"scale": "weight", "offset": "bias"})
    return (Piece(LayerNorm(eps=float(norm.eps)), weights),)


def _embedding(step: Step) -> Conversion:
    table = _module(step)
    step.option("padding_idx", table.padding_idx, None, "the plan's embedding trains every row")
    step.option("max_norm", table.max_norm, None, "the plan's embedding does not renormalise rows")
    step.option(
        "scale_grad_by_freq", table.scale_grad_by_freq, False, "the plan's gradients are not rescaled"
    )
    step.option("sparse", table.sparse, False, "the plan's gradients are dense")
    layer = Embedding(vocab_size=table.num_embeddings, units=table.embedding_dim)
    return (Piece(layer, _module_weights(Embedding, table, {"table": "weight"})),)


def _attention(step: Step) -> Conversion:
    """Self-attention (query, key and value one tensor, batch_first): torch's packed
    ``in_proj_weight`` [3E, E] is the plan's query, key and value kernels, each transposed."""
    attention = _module(step)
    step.option("batch_first", attention.batch_first, True, "the plan's sequences are [batch, length, units]")
    step.option("dropout", attention.dropout, 0.0, "the plan's attention drops no attention weights")
    if not attention._qkv_same_embed_dim:
        raise step.refuse("kdim/vdim: the plan's keys and values have the input's width")
    if attention.bias_k is not None or attention.add_zero_attn:
        raise step.refuse("add_bias_kv/add_zero_attn: the plan attends to the sequence only")
    if step.argument(3, "key_padding_mask", None) is not None:
        raise step.refuse("key_padding_mask: the plan's attention takes no padding mask from a torch module")
    causal = _is_causal(step)
    sources = {value.source for value in step.inputs[:3]}
    if len(step.inputs) != 3 or len(sources) != 1:
        raise step.refuse("query, key and value differ: the plan's attention is self-attention")
    use_bias = attention.in_proj_bias is not None
    weights: Weights = {}
    packed = attention.in_proj_weight.chunk(3)
    biases = attention.in_proj_bias.chunk(3) if use_bias else (None, None, None)
    projections = ("query", "key", "value")
    for projection, kernel, bias in zip(projections, packed, biases, strict=True):
        weights[f"{projection}_kernel"] = _neutral(Attention, f"{projection}_kernel", kernel)
        if bias is not None:
            weights[f"{projection}_bias"] = _neutral(Attention, f"{projection}_bias", bias)
    weights["output_kernel"] = _neutral(Attention, "output_kernel", attention.out_proj.weight)
    if attention.out_proj.bias is not None:
        weights["output_bias"] = _neutral(Attention, "output_bias", attention.out_proj.bias)
    return (Piece(Attention(heads=attention.num_heads, causal=causal, use_bias=use_bias), weights),)


def _is_causal(step: Step) -> bool:
    """Whether MultiheadAttention masks later positions: its ``attn_mask`` is a parameter or
    buffer that holds the causal mask (True, or -inf, above the diagonal; ``is_causal=True``
    is torch's hint that it is), or there is none."""
    mask = step.argument(5, "attn_mask", None)
    if mask is None:
        if step.argument(7, "is_causal", False):
            raise step.refuse("is_causal=True without attn_mask: torch asks for the causal mask too")
        return False
    length = step.inputs[0].shape[1]
    later = torch.ones(length, length, dtype=torch.bool).triu(1)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (length, length):
        raise step.refuse(f"attn_mask: the plan's attention takes a causal mask [{length}, {length}] only")
    mask = mask.detach().cpu()
    if mask.dtype == torch.bool:
        causal = bool(torch.equal(mask, later))
    else:
        causal = bool((mask[later] == float("-inf")).all() and (mask[~later] == 0).all())
    if not causal:
        raise step.refuse("attn_mask: not the causal mask; the plan's attention masks later positions only")
    return True


#: modules, functions and methods that are one plan layer with no options (core's classes
#: written ``neutral.X``, so a new row needs no import)
_ELEMENTWISE: dict[Any, Layer] = {
    nn.ReLU: neutral.ReLU(),
    nn.SiLU: neutral.SiLU(),
    nn.Tanh: neutral.Tanh(),
    nn.Sigmoid: neutral.Sigmoid(),
    nn.ReLU6: neutral.ReLU6(),
    nn.Hardswish: neutral.HardSwish(),
    F.relu: neutral.ReLU(),
    torch.relu: neutral.ReLU(),
    F.silu: neutral.SiLU(),
    F.relu6: neutral.ReLU6(),
    F.hardswish: neutral.HardSwish(),
    torch.sigmoid: neutral.Sigmoid(),
    torch.tanh: neutral.Tanh(),
    "Tensor.relu": neutral.ReLU(),
    "Tensor.sigmoid": neutral.Sigmoid(),
    "Tensor.tanh": neutral.Tanh(),
}


#: every module class, function and tensor method that imports: its converter
CONVERTERS: dict[Any, Converter] = {
    **{key: Converter(_fixed(layer), carries_order=True) for key, layer in _ELEMENTWISE.items()},
    nn.Linear: Converter(_linear, reads_order=_linear_reading_order),
    nn.Conv2d: Converter(_conv2d),
    nn.Conv1d: Converter(_conv1d),
    nn.ConvTranspose2d: Converter(_conv_transpose2d),
    nn.MaxPool2d: Converter(_pool(MaxPool2D)),
    nn.AvgPool2d: Converter(_pool(AvgPool2D)),
    nn.AdaptiveAvgPool2d: Converter(_adaptive_avg_pool),
    nn.Flatten: Converter(_flatten_module, flattens=True),
    torch.flatten: Converter(_flatten_call, flattens=True),
    "Tensor.flatten": Converter(_flatten_call, flattens=True),
    "Tensor.view": Converter(_view, flattens=True),
    "Tensor.reshape": Converter(_view, flattens=True),
    torch.reshape: Converter(_view, flattens=True),
    "Tensor.size": Converter(_no_layers, sizes=_size),
    torch.mean: Converter(_mean_call),
    "Tensor.mean": Converter(_mean_call),
    torch.cat: Converter(_concat),
    nn.GELU: Converter(_gelu(lambda step: _module(step).approximate), carries_order=True),
    F.gelu: Converter(_gelu(lambda step: step.argument(1, "approximate", "none")), carries_order=True),
    nn.LeakyReLU: Converter(_leaky_relu, carries_order=True),
    nn.Softmax: Converter(_softmax(lambda step: _module(step).dim)),
    F.softmax: Converter(_softmax(lambda step: step.argument(1, "dim", None))),
    "Tensor.softmax": Converter(_softmax(lambda step: step.argument(1, "dim", None))),
    nn.Dropout: Converter(_dropout, carries_order=True),
    nn.Identity: Converter(_identity, carries_order=True),
    nn.BatchNorm2d: Converter(_batchnorm),
    nn.BatchNorm1d: Converter(_batchnorm),
    nn.LayerNorm: Converter(_layernorm),
    nn.Embedding: Converter(_embedding),
    nn.MultiheadAttention: Converter(_attention),
    operator.getitem: Converter(_getitem),
    operator.add: Converter(_arithmetic("add")),
    torch.add: Converter(_arithmetic("add")),
    operator.mul: Converter(_arithmetic("multiply")),
    torch.mul: Converter(_arithmetic("multiply")),
}


#: why some classes and functions have no plan equivalent (any other: it has none)
NO_EQUIVALENT: dict[str, str] = {
    "AdaptiveMaxPool2d": "the plan has no maximum over positions",
    "GroupNorm": "the plan has no group normalization",
    "torch._C._nn.scaled_dot_product_attention": (
        "attention from your own projections: the plan's attention is one layer with its "
        "projections; use nn.MultiheadAttention"
    ),
}
