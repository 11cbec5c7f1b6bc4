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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.model.graph import INPUT_NAME, build_graph
from crosstrain.core.model.layers import (
    DType,
    Layer,
    Shape,
)
from crosstrain.importers.common import Conversion, ImportedModel, ImportResult, Weights, write_import
from crosstrain.importers.torch_converters import _channels_last, _flatten_order
from crosstrain.importers.torch_steps import Converter, ImportRefused, Step, Value
from crosstrain.importers.torch_table import CONVERTERS, NO_EQUIVALENT


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
        if converter.sizes is not None:
            self.values[step.node] = converter.sizes(step)
            return
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
            flattened = converter.flattens and len(step.shape) == 2  # to [batch, features]
            return pieces, _flatten_order(step.inputs[0]) if flattened else order
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


def _key(step: Step) -> Any:
    if step.module is not None:
        return type(step.module)
    if step.node.op == "call_method":
        return f"Tensor.{step.node.target}"
    return step.node.target
