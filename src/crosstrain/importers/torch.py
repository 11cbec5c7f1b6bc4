"""A torch ``nn.Module`` (``crosstrain import module:factory --framework torch``) as a plan
and its weights.

The module is traced with ``torch.fx.symbolic_trace``: a graph of its ``forward``, one fx
node per ``torch.nn`` layer called (``call_module``), function (``call_function``: ``+``,
``torch.cat``, ``F.relu``) or tensor method (``call_method``: ``x.flatten(1)``), each after
what it reads. ``ShapeProp`` runs the module once on zeros of the given input shape (in
eval mode, so nothing in it moves) and records every node's torch shape. Each node has one
converter in :data:`CONVERTERS`, keyed by the module's exact class (torch.fx opens a module of
one's own, a subclass of a torch layer included, into what it calls), the function, or
``"Tensor.{method}"``; anything else
is refused in one line naming the fx node, its target or class and the option
(:class:`ImportRefused`, exit 2).

**Images.** torch's images are NCHW, the plan's NHWC. Every 4-D tensor of the module is
read as an image ``[batch, C, H, W]`` whose plan twin is ``[H, W, C]``: a ``dim`` argument
is moved to the plan's axis, weights are laid out as the torch backend lays them out
(:data:`crosstrain.backends.torch.layers.LAYERS`, read in reverse). Flattening an image
orders its features C, H, W in torch and H, W, C in the plan: the features keep a record of
the permutation (:attr:`Value.order`), elementwise ops carry it, and the ``Linear`` that
reads them gets its weight's columns permuted to match (with a note); anything else reading
permuted features is refused.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import operator
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from crosstrain.backends.torch.layers import LAYERS as TORCH_LAYERS
from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.graph import INPUT_NAME, build_graph
from crosstrain.core.layers import (
    GELU,
    Add,
    Attention,
    AvgPool2D,
    BatchNorm,
    Concat,
    Conv2D,
    Dense,
    Dropout,
    DType,
    Embedding,
    Flatten,
    HardSwish,
    Layer,
    LayerNorm,
    LeakyReLU,
    MaxPool2D,
    Mean,
    Multiply,
    PositionEmbedding,
    ReLU,
    ReLU6,
    Rescale,
    Shape,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
    ZeroPad2D,
)
from crosstrain.importers.common import Conversion, ImportedModel, ImportResult, Piece, Weights, write_import


class ImportRefused(InputError):
    """An fx node (or an option of one) that no plan layer computes."""


@attrs.frozen(eq=False)
class Value:
    """What an fx node gives, as the plan sees it: the plan layer that makes it, its torch
    shape (batch axis included) and, for an image's flattened features, ``order``: plan
    feature i is torch feature ``order[i]``. ``is_pair`` marks MultiheadAttention's
    (output, weights) pair, of which only item 0 is read."""

    source: str
    shape: tuple[int, ...]
    order: np.ndarray | None = None
    is_pair: bool = False

    @property
    def image(self) -> bool:
        return len(self.shape) == 4

    def plan_axis(self, dim: int) -> int:
        """A torch ``dim`` (batch axis 0, negative from the end) as the plan's row axis."""
        rank = len(self.shape)
        dim = dim + rank if dim < 0 else dim
        if dim == 0:
            raise ValueError("the batch axis")
        if self.image:
            return {1: 2, 2: 0, 3: 1}[dim]
        return dim - 1


@attrs.frozen
class Step:
    """One fx node to convert: the node, its live module (``call_module``), the values among
    its arguments in order, its other arguments and keyword arguments."""

    node: fx.Node
    module: nn.Module | None
    arguments: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    shape: tuple[int, ...]  # the node's torch output shape (batch axis included)

    @property
    def inputs(self) -> tuple[Value, ...]:
        """The values among the positional arguments, in order (``torch.cat``'s list opened)."""
        return tuple(argument for argument in _flat(self.arguments) if isinstance(argument, Value))

    @property
    def constants(self) -> tuple[Any, ...]:
        return tuple(argument for argument in self.arguments if not isinstance(argument, Value))

    @property
    def shown(self) -> str:
        if self.module is not None:
            return type(self.module).__name__
        target = self.node.target
        if isinstance(target, str):
            return f"Tensor.{target}"
        module = (getattr(target, "__module__", "") or "").removeprefix("_")  # _operator: operator
        return f"{module}.{getattr(target, '__name__', target)}".lstrip(".")

    def refuse(self, problem: str) -> ImportRefused:
        return ImportRefused(f"fx node {self.node.name!r} ({self.shown}): {problem}")

    def argument(self, index: int, key: str, default: Any) -> Any:
        """A call's argument by position (among all its arguments) or keyword."""
        if key in self.kwargs:
            return self.kwargs[key]
        return self.arguments[index] if index < len(self.arguments) else default

    def option(self, key: str, value: Any, expected: Any, why: str) -> None:
        """Refuse unless ``value`` (the module's ``key``) is ``expected`` (one or a tuple)."""
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if value not in allowed:
            raise self.refuse(f"{key}={value!r}: {why}")

    def plan_axis(self, dim: int) -> int:
        try:
            return self.inputs[0].plan_axis(dim)
        except ValueError:
            raise self.refuse(
                f"dim={dim}: the plan's layers act within a row, not across the batch"
            ) from None


@attrs.frozen
class Converter:
    """How one module class, function or method becomes plan layers, and what it does with
    an image's features flattened in torch's order (refused unless one of these says):
    ``carries_order`` (elementwise: its output keeps the order), ``reads_order`` (takes the
    order into its weights: a Linear)."""

    convert: Callable[[Step], Conversion]
    carries_order: bool = False
    reads_order: Callable[[Step, np.ndarray], Conversion] | None = None
    #: it flattens: its output's features are in torch's order (:func:`_flatten_order`)
    flattens: bool = False


# --------------------------------------------------------------------------- entry points


def import_factory(
    target: str,
    input_shape: Shape,
    out: str | Path,
    weights: str | Path | None = None,
    overwrite: bool = False,
) -> ImportResult:
    """``crosstrain import module:factory --framework torch``: call the factory, import its
    module (``input_shape``: one row, channels-last), write the plan and weights."""
    module = load_factory(target)()
    if not isinstance(module, nn.Module):
        raise InputError(f"{target}: returned {type(module).__name__}, not a torch nn.Module")
    return write_import(
        convert_module(module, input_shape, name=target.rpartition(":")[2]), out, weights, overwrite
    )


def load_factory(target: str) -> Callable[[], Any]:
    """``package.module:function`` (as a plan names a native model), the current folder first
    on the import path, as for ``python -c``."""
    module_name, colon, function_name = target.partition(":")
    if not colon or not module_name or not function_name:
        raise InputError(f"{target}: name the torch module's factory as package.module:function")
    folder = os.getcwd()
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise InputError(f"{target}: cannot load it: {error}") from None
    if not callable(factory):
        raise InputError(f"{target}: is not callable")
    return factory  # type: ignore[no-any-return]


def convert_module(module: nn.Module, input_shape: Shape, name: str = "model") -> ImportedModel:
    """The module as plan layers and neutral weights (nothing written); ``input_shape`` is
    the plan's row (channels-last: ``[32, 32, 3]`` for torch's ``[3, 32, 32]``)."""
    try:
        traced = fx.symbolic_trace(module)
    except Exception as error:  # torch.fx's own reason (data-dependent control flow), one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{name}: torch.fx cannot trace it: {first}") from None
    placeholders = [node for node in traced.graph.nodes if node.op == "placeholder"]
    if len(placeholders) != 1:
        raise InputError(f"{name}: forward takes {len(placeholders)} inputs; a plan has one")
    input_dtype = _input_dtype(traced, placeholders[0])
    _propagate_shapes(traced, _torch_shape(input_shape), input_dtype)
    assembly = _Assembly()
    assembly.values[placeholders[0]] = Value(INPUT_NAME, (1, *_torch_shape(input_shape)))
    modules = dict(traced.named_modules())
    for node in traced.graph.nodes:
        if node.op in ("call_module", "call_function", "call_method"):
            assembly.add(_step(node, modules, assembly))
        elif node.op == "get_attr":
            assembly.values[node] = _attribute(traced, node)
        elif node.op == "output":
            assembly.finish(node)
    assembly.check_shapes(input_shape, input_dtype)
    return ImportedModel(
        name=name,
        input_shape=input_shape,
        input_dtype=input_dtype,
        layers=tuple(assembly.layers),
        weights=assembly.weights,
        origin=f"the torch module {name!r} ({type(module).__name__}, torch {torch.__version__})",
        notes=tuple(assembly.notes),
    )


def _torch_shape(input_shape: Shape) -> tuple[int, ...]:
    """The plan's row as torch reads it: an image [h, w, c] is [c, h, w]."""
    if len(input_shape) == 3:
        height, width, channels = input_shape
        return (channels, height, width)
    return tuple(input_shape)


def _input_dtype(traced: fx.GraphModule, placeholder: fx.Node) -> DType:
    """Token ids (int32) where every reader of the input is an Embedding, else float32."""
    readers = [
        traced.get_submodule(str(user.target)) if user.op == "call_module" else None
        for user in placeholder.users
    ]
    if readers and all(type(reader) is nn.Embedding for reader in readers):
        return "int32"
    return "float32"


def _propagate_shapes(traced: fx.GraphModule, shape: tuple[int, ...], dtype: DType) -> None:
    """Every node's torch shape (``node.meta["tensor_meta"]``), from one forward of a batch
    of two rows of zeros in eval mode (batch norm's statistics stay as they are)."""
    example = torch.zeros((2, *shape), dtype=torch.long if dtype == "int32" else torch.float32)
    training = traced.training
    traced.eval()
    try:
        # ShapeProp prints the failing node's traceback itself; the reason is said once, below
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            ShapeProp(traced).propagate(example)
    except Exception as error:
        reason = error.__cause__ or error  # ShapeProp wraps the module's own error
        first = str(reason).strip().splitlines()[0] if str(reason).strip() else type(reason).__name__
        sizes = ",".join(str(size) for size in _channels_last(shape))
        raise InputError(
            f"--input-shape {sizes}: the module's forward fails on rows of torch shape {list(shape)}: {first}"
        ) from None
    finally:
        traced.train(training)


def _step(node: fx.Node, modules: Mapping[str, nn.Module], assembly: _Assembly) -> Step:
    module = modules[str(node.target)] if node.op == "call_module" else None
    arguments = tuple(assembly.value_of(argument) for argument in node.args)
    kwargs = {key: assembly.value_of(value) for key, value in node.kwargs.items()}
    meta = node.meta.get("tensor_meta")
    shape = tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()
    return Step(node, module, arguments, kwargs, shape)


def _flat(arguments: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for argument in arguments:
        flat.extend(_flat(argument) if isinstance(argument, list | tuple) else [argument])
    return flat


def _attribute(traced: fx.GraphModule, node: fx.Node) -> Any:
    """A parameter the forward reads directly (a learned position table): its values."""
    value = traced
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value


@attrs.define
class _Assembly:
    """The plan as it grows: each fx node's value, the named layers, the weights, notes."""

    values: dict[fx.Node, Any] = attrs.field(factory=dict)
    layers: list[Layer] = attrs.field(factory=list)
    weights: Weights = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    torch_shapes: dict[str, tuple[int, ...]] = attrs.field(factory=dict)

    def value_of(self, argument: Any) -> Any:
        """An fx argument with each node in it (in a list or tuple too) as its value."""
        if isinstance(argument, list | tuple):
            return type(argument)(self.value_of(item) for item in argument)
        return self.values.get(argument, argument) if isinstance(argument, fx.Node) else argument

    def add(self, step: Step) -> None:
        converter = CONVERTERS.get(_key(step))
        if converter is None:
            raise step.refuse(
                f"{NO_EQUIVALENT.get(step.shown, 'has no plan equivalent')} (what imports: docs/import.md)"
            )
        if (
            any(isinstance(value, Value) and value.is_pair for value in step.inputs)
            and _key(step) is not operator.getitem
        ):
            raise step.refuse("reads MultiheadAttention's (output, weights) pair; take its item 0")
        try:
            pieces, order = self._converted(step, converter)
        except ValueError as error:  # a core layer's own check
            raise step.refuse(str(error)) from None
        self._append(step, pieces, order)

    def _converted(self, step: Step, converter: Converter) -> tuple[Conversion, np.ndarray | None]:
        """The step's pieces and the order of its output's features (None: the plan's)."""
        order = next((value.order for value in step.inputs if value.order is not None), None)
        if order is None or converter.carries_order:
            pieces = converter.convert(step)
            return pieces, _flatten_order(step.inputs[0]) if converter.flattens else order
        if converter.reads_order is None:
            raise step.refuse(
                "reads an image's features flattened in torch's C, H, W order; only a Linear "
                "(and elementwise ops before it) can read them (the plan flattens H, W, C)"
            )
        self.notes.append(_ORDER_NOTE.format(name=step.node.name))
        return converter.reads_order(step, order), None

    def _append(self, step: Step, pieces: Conversion, order: np.ndarray | None) -> None:
        sources = [value.source for value in step.inputs]
        if not pieces:  # the input passes through (item 0 of attention's pair: its output)
            self.values[step.node] = Value(sources[0], step.shape, order)
            if _key(step) is operator.getitem:
                self.torch_shapes[sources[0]] = step.shape
            return
        if pieces[0].layer.arity == 1:  # self-attention reads query, key and value: one tensor
            if len(set(sources)) != 1:
                raise step.refuse(f"reads {len(set(sources))} tensors; its plan layer reads one")
            sources = sources[:1]
        for piece in pieces:
            name = f"{step.node.name}_{piece.suffix}" if piece.suffix else step.node.name
            if name == INPUT_NAME or any(layer.name == name for layer in self.layers):
                raise step.refuse(f"its plan layer would be named {name!r}, which another layer has")
            before = self.layers[-1].name if self.layers else INPUT_NAME
            inputs = None if sources == [before] else tuple(sources)
            self.layers.append(attrs.evolve(piece.layer, name=name, inputs=inputs))
            self.weights.update({f"{name}.{param}": value for param, value in piece.weights.items()})
            sources = [name]
        is_pair = type(step.module) is nn.MultiheadAttention
        self.values[step.node] = Value(sources[0], step.shape, order, is_pair)
        if not is_pair:
            self.torch_shapes[sources[0]] = step.shape

    def finish(self, node: fx.Node) -> None:
        """The module's output must be one tensor the last plan layer makes."""
        result = self.value_of(node.args[0])
        if not isinstance(result, Value) or result.is_pair:
            raise ImportRefused(
                f"fx node {node.name!r} (output): the forward returns {type(result).__name__}; "
                f"a plan has one output tensor"
            )
        if result.order is not None:
            raise ImportRefused(
                f"fx node {node.name!r} (output): returns an image's features flattened in torch's C, H, W "
                f"order; the plan's would be H, W, C"
            )
        if not self.layers or result.source != self.layers[-1].name:
            raise ImportRefused(
                f"fx node {node.name!r} (output): returns {result.source!r}, not the last layer's output"
            )
        if result.image:
            self.notes.append(
                "The module returns an image: the plan's output is its NHWC (channels-last) twin."
            )

    def check_shapes(self, input_shape: Shape, input_dtype: DType) -> None:
        """Each plan layer's output shape is its fx node's, read channels-last: a converter
        that missed an option would show here, not in a wrong forward."""
        try:
            graph = build_graph(input_shape, self.layers, None, input_dtype)
        except PlanError as error:  # each plan layer has its fx node's name: the error names it
            raise ImportRefused(
                f"the imported plan does not check (layers named as their fx nodes): {error}"
            ) from None
        for node in graph.nodes:
            torch_shape = self.torch_shapes.get(node.path)
            if torch_shape is None:
                continue
            expected = _channels_last(torch_shape[1:])
            if tuple(node.output_shape) != expected:
                raise ImportRefused(
                    f"fx node {node.path!r}: its plan layers give shape {list(node.output_shape)}, "
                    f"torch's gives "
                    f"{list(torch_shape[1:])} (channels-last {list(expected)})"
                )


_ORDER_NOTE = (
    "The Linear {name!r} reads an image's features flattened by torch as C, H, W; the plan "
    "flattens H, W, C, so its kernel's rows are permuted to match (same outputs)."
)


def _channels_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 3:
        channels, height, width = shape
        return (height, width, channels)
    return shape


def _key(step: Step) -> Any:
    if step.module is not None:
        return type(step.module)
    if step.node.op == "call_method":
        return f"Tensor.{step.node.target}"
    return step.node.target


# --------------------------------------------------------------------------- weights


def _neutral(layer_type: type[Layer], param: str, tensor: torch.Tensor) -> np.ndarray:
    """A torch weight in its neutral layout: the torch backend's layout (neutral -> torch
    axes, :data:`crosstrain.backends.torch.layers.LAYERS`) undone."""
    _, axes = TORCH_LAYERS[layer_type].layout[param]
    array = tensor.detach().to("cpu", torch.float32).numpy()
    return array if axes is None else np.ascontiguousarray(array.transpose(np.argsort(axes)))


def _module_weights(layer_type: type[Layer], module: nn.Module, names: Mapping[str, str]) -> Weights:
    """The module's tensors ``names`` (neutral param -> torch attribute) that exist."""
    weights: Weights = {}
    for param, attribute in names.items():
        tensor = getattr(module, attribute, None)
        if tensor is not None:
            weights[param] = _neutral(layer_type, param, tensor)
    return weights


def _module(step: Step) -> Any:
    assert step.module is not None
    return step.module


# --------------------------------------------------------------------------- dense and convolutions


def _linear(step: Step) -> Conversion:
    if step.inputs[0].image:
        raise step.refuse(
            "reads an image (NCHW); torch's Linear would act on its width, the plan's dense on channels"
        )
    linear = _module(step)
    dense = Dense(units=linear.out_features, use_bias=linear.bias is not None)
    return (Piece(dense, _module_weights(Dense, linear, {"kernel": "weight", "bias": "bias"})),)


def _linear_reading_order(step: Step, order: np.ndarray) -> Conversion:
    """A Linear after flattening an image: plan feature i is torch feature order[i], so the
    plan kernel's row i is torch weight's column order[i]."""
    (piece,) = _linear(step)
    weights = dict(piece.weights)
    weights["kernel"] = np.ascontiguousarray(weights["kernel"][order])
    return (attrs.evolve(piece, weights=weights),)


def _pair(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _conv2d(step: Step) -> Conversion:
    """torch's padding p (zeros on both sides): TensorFlow's ``same`` where it is that
    (stride 1, 2p = the window - 1), else a zero_pad2d then a ``valid`` convolution."""
    conv = _module(step)
    step.option("padding_mode", conv.padding_mode, "zeros", "the plan's convolutions pad with zeros")
    kernel, strides, dilation = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.dilation)
    weights = _module_weights(Conv2D, conv, {"kernel": "weight", "bias": "bias"})
    options = {
        "filters": conv.out_channels,
        "kernel_size": kernel,
        "strides": strides,
        "dilation": dilation,
        "groups": conv.groups,
        "use_bias": conv.bias is not None,
    }
    if conv.padding == "same":
        return (Piece(Conv2D(padding="same", **options), weights),)
    padding = (0, 0) if conv.padding == "valid" else _pair(conv.padding)
    windows = [(size - 1) * rate + 1 for size, rate in zip(kernel, dilation, strict=True)]
    if padding == (0, 0):
        return (Piece(Conv2D(padding="valid", **options), weights),)
    if strides == (1, 1) and all(2 * pad == window - 1 for pad, window in zip(padding, windows, strict=True)):
        return (Piece(Conv2D(padding="same", **options), weights),)
    pad = ZeroPad2D(padding=((padding[0], padding[0]), (padding[1], padding[1])))
    return (Piece(pad, suffix="pad"), Piece(Conv2D(padding="valid", **options), weights))


def _pool(kind: type[MaxPool2D] | type[AvgPool2D]) -> Callable[[Step], Conversion]:
    def convert(step: Step) -> Conversion:
        pool = _module(step)
        step.option("padding", _pair(pool.padding), ((0, 0),), "a plan's pools are 'valid' (no padding)")
        step.option("ceil_mode", pool.ceil_mode, False, "a plan's pools drop a partial window")
        if kind is MaxPool2D:
            step.option("dilation", _pair(pool.dilation), ((1, 1),), "a plan's pools have no dilation")
            step.option("return_indices", pool.return_indices, False, "a plan layer has one output")
        else:
            step.option(
                "divisor_override", pool.divisor_override, None, "a plan's average divides by the window"
            )
        size = _pair(pool.kernel_size)
        strides = _pair(pool.stride or pool.kernel_size)
        if len(set(size)) != 1 or len(set(strides)) != 1:
            raise step.refuse(f"kernel_size={size} stride={strides}: a plan's pools are square")
        return (Piece(kind(pool_size=size[0], strides=None if strides == size else strides[0])),)

    return convert


def _adaptive_avg_pool(step: Step) -> Conversion:
    """AdaptiveAvgPool2d(1): the mean over height and width, kept as [1, 1, C]."""
    step.option(
        "output_size", _pair(_module(step).output_size), ((1, 1),), "the plan averages a whole image only"
    )
    return (Piece(Mean(axes=(0, 1), keepdims=True)),)


# --------------------------------------------------------------------------- shapes


def _flatten(step: Step, start: int, end: int) -> Conversion:
    """Flatten from axis 1 to the last: an image's features (C, H, W in torch) record their
    order for the Linear that reads them."""
    value = step.inputs[0]
    rank = len(value.shape)
    if start != 1 or end not in (-1, rank - 1):
        raise step.refuse(f"start_dim={start} end_dim={end}: the plan flattens every axis of a row")
    return (Piece(Flatten()),)


def _flatten_order(value: Value) -> np.ndarray | None:
    """Plan feature i (H, W, C order) is torch feature order[i] (C, H, W); None when equal."""
    if not value.image:
        return None
    channels, height, width = value.shape[1:]
    order = np.arange(channels * height * width).reshape(channels, height, width).transpose(1, 2, 0).ravel()
    return None if np.array_equal(order, np.arange(order.size)) else order


def _flatten_module(step: Step) -> Conversion:
    flatten = _module(step)
    return _flatten(step, flatten.start_dim, flatten.end_dim)


def _flatten_call(step: Step) -> Conversion:
    return _flatten(step, step.argument(1, "start_dim", 0), step.argument(2, "end_dim", -1))


def _mean_call(step: Step) -> Conversion:
    dims = step.argument(1, "dim", None)
    if dims is None:
        raise step.refuse("a mean over the batch too: the plan's mean is within a row")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    keepdims = bool(step.argument(2, "keepdim", False))
    if step.argument(3, "dtype", None) is not None:
        raise step.refuse("dtype: the plan's mean keeps the compute dtype")
    axes = tuple(sorted(step.plan_axis(dim) for dim in dims))
    return (Piece(Mean(axes=axes, keepdims=keepdims)),)


def _concat(step: Step) -> Conversion:
    dim = step.argument(1, "dim", 0)
    rank = len(step.inputs[0].shape)
    if step.plan_axis(dim) != rank - 2:
        raise step.refuse(f"dim={dim}: the plan's concat joins channels (the last axis channels-last)")
    return (Piece(Concat()),)


# --------------------------------------------------------------------------- activations and merges


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
    """Item 0 of MultiheadAttention's (output, weights): its output."""
    if not step.inputs or not step.inputs[0].is_pair or step.constants != (0,):
        raise step.refuse(
            "indexing a tensor: the plan has no slicing (item 0 of MultiheadAttention's pair only)"
        )
    return ()


# --------------------------------------------------------------------------- normalisation and sequences


def _batchnorm(step: Step) -> Conversion:
    norm = _module(step)
    if len(step.inputs[0].shape) == 3:
        raise step.refuse(
            f"on {list(step.inputs[0].shape[1:])}: torch normalises axis 1 of [batch, C, L], the plan's "
            f"batchnorm the last axis"
        )
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
    return (Piece(layer, _module_weights(BatchNorm, norm, names)),)


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
    for key in ("key_padding_mask", "attn_mask"):
        if step.argument(3 if key == "key_padding_mask" else 5, key, None) is not None:
            raise step.refuse(f"{key}: the plan's attention takes no mask from a torch module")
    if step.argument(7, "is_causal", False):
        raise step.refuse(
            "is_causal: torch's is a hint for an attn_mask; the plan's attention takes no mask here"
        )
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
    return (Piece(Attention(heads=attention.num_heads, use_bias=use_bias), weights),)


# --------------------------------------------------------------------------- the table

_ELEMENTWISE: dict[Any, Layer] = {
    nn.ReLU: ReLU(),
    nn.SiLU: SiLU(),
    nn.Tanh: Tanh(),
    nn.Sigmoid: Sigmoid(),
    nn.ReLU6: ReLU6(),
    nn.Hardswish: HardSwish(),
    F.relu: ReLU(),
    torch.relu: ReLU(),
    F.silu: SiLU(),
    F.relu6: ReLU6(),
    F.hardswish: HardSwish(),
    torch.sigmoid: Sigmoid(),
    torch.tanh: Tanh(),
    "Tensor.relu": ReLU(),
    "Tensor.sigmoid": Sigmoid(),
    "Tensor.tanh": Tanh(),
}

#: every module class, function and tensor method that imports: its converter
CONVERTERS: dict[Any, Converter] = {
    **{key: Converter(_fixed(layer), carries_order=True) for key, layer in _ELEMENTWISE.items()},
    nn.Linear: Converter(_linear, reads_order=_linear_reading_order),
    nn.Conv2d: Converter(_conv2d),
    nn.MaxPool2d: Converter(_pool(MaxPool2D)),
    nn.AvgPool2d: Converter(_pool(AvgPool2D)),
    nn.AdaptiveAvgPool2d: Converter(_adaptive_avg_pool),
    nn.Flatten: Converter(_flatten_module, flattens=True),
    torch.flatten: Converter(_flatten_call, flattens=True),
    "Tensor.flatten": Converter(_flatten_call, flattens=True),
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
    "Tensor.view": "a view's sizes come from the batch at run time: use flatten",
    "Tensor.reshape": "a reshape's sizes come from the batch at run time: use flatten",
    "Tensor.size": "the plan's shapes are fixed: use flatten rather than sizes read at run time",
}
