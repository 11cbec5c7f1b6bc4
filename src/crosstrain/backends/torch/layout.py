"""Where the torch backend keeps each image: NCHW between the nodes that can read it so
(convolutions, pooling, batch norm...), the neutral NHWC at the edges and for the nodes
that need it, each image permuted at most once; and two rewrites of the forward's steps
that change no value: a symmetric zero padding folded into the node that reads it, and an
activation that only a max pool reads run after the pool."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from crosstrain.backends.torch.layers import LAYERS
from crosstrain.backends.torch.nodes import Order, to_nchw, to_nhwc
from crosstrain.core.model.graph import MODEL_INPUT, Graph, Node
from crosstrain.core.model.layers import Conv2D, MaxPool2D, ReLU, ReLU6, ZeroPad2D


def _readers(graph: Graph) -> dict[int, list[Node]]:
    """Each value (a node's index, or MODEL_INPUT) -> the nodes that read it."""
    readers: dict[int, list[Node]] = {}
    for node in graph.nodes:
        for source in node.inputs:
            readers.setdefault(source, []).append(node)
    return readers


class Step(NamedTuple):
    """One step of the forward: graph node ``node`` on the values ``sources``, or, where
    ``permute`` is set, that change of order of the value ``sources[0]``; the result is the
    value ``target``. Values are keyed by node index (MODEL_INPUT: the input); a value's
    copy in the other order by a key below MODEL_INPUT."""

    node: int
    sources: tuple[int, ...]
    target: int
    permute: Callable[[torch.Tensor], torch.Tensor] | None = None


class LayoutPlan(NamedTuple):
    """Where images are NCHW: per node, whether its 4-D inputs and output are
    (``channels_first``); the steps of the forward, permutations included; the key of
    the value the model returns (NHWC, if an image); and the zero paddings folded into the
    node that reads them (:func:`folded_paddings`: reader's index -> (height, width))."""

    channels_first: tuple[bool, ...]
    steps: tuple[Step, ...]
    output: int
    absorbed: Mapping[int, tuple[int, int]] = {}

    @property
    def permutations(self) -> int:
        return sum(step.permute is not None for step in self.steps)


def _is_image(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3  # one row's [height, width, channels]: a 4-D tensor


#: layers whose outputs are never negative: zeros padding their output lose to a real cell
#: in a max pool as torch's -inf padding does (a tie of zeros goes back through the ReLU's
#: zero gradient either way)
_NON_NEGATIVE = (ReLU, ReLU6)


def folded_paddings(graph: Graph) -> dict[int, tuple[int, int]]:
    """The symmetric ``zero_pad2d`` nodes that the one node reading them pads itself:
    pad node -> its (height, width) padding. A convolution takes any such padding into its
    own (exact: both pad with zeros); a valid max pool takes one of at most half its window
    when the padded value is never negative. Each saves a copy of the image forward and
    one of its gradient backward (torchvision's ResNet pads inside its stem's convolution
    and pool; the plan, written for every backend, pads explicitly)."""
    readers = _readers(graph)
    folds = {}
    for node in graph.nodes:
        if not isinstance(node.layer, ZeroPad2D) or node.index == graph.output:
            continue
        (top, bottom), (left, right) = node.layer.padding
        found = readers.get(node.index, [])
        if top != bottom or left != right or len(found) != 1:
            continue
        if _absorbs(found[0], node, graph, (top, left)):
            folds[node.index] = (top, left)
    return folds


def _absorbs(reader: Node, pad: Node, graph: Graph, padding: tuple[int, int]) -> bool:
    layer = reader.layer
    if isinstance(layer, Conv2D):
        return all(before == after for before, after in layer.paddings(reader.input_shape))
    if isinstance(layer, MaxPool2D) and layer.padding == "valid":
        source = pad.inputs[0]
        fits = max(padding) <= layer.pool_size // 2
        return fits and source != MODEL_INPUT and isinstance(graph.nodes[source].layer, _NON_NEGATIVE)
    return False


#: activations that commute with a max pool: each is non-decreasing, so a window's largest
#: activated cell is the activation of its largest cell, and both orders send the gradient
#: to the same cell (the window's first largest), through the same derivative
_MONOTONE = (ReLU, ReLU6)


def activations_pooled_first(graph: Graph, absorbed: Mapping[int, tuple[int, int]]) -> dict[int, int]:
    """The ReLU (or ReLU6) nodes whose one reader is a valid max pool that pads nothing:
    activation -> pool. The forward pools first and activates the pooled cells, a quarter of
    them under a 2x2 pool: the same values and gradients bit for bit (both are exact), and
    the activation's read, write and mask over the whole image are saved forward and
    backward (what a compiler's fusion saves; the step replayed as a CUDA graph runs each
    kernel on its own)."""
    readers = _readers(graph)
    pooled = {}
    for node in graph.nodes:
        found = readers.get(node.index, [])
        if not isinstance(node.layer, _MONOTONE) or node.index == graph.output or len(found) != 1:
            continue
        pool = found[0]
        if isinstance(pool.layer, MaxPool2D) and pool.layer.padding == "valid" and pool.index not in absorbed:
            pooled[node.index] = pool.index
    return pooled


def _pool_before_activation(steps: list[Step], pooled: Mapping[int, int]) -> list[Step]:
    """``steps`` with each pool of ``pooled`` reading its activation's input, and the
    activation then reading the pool's output into the pool's value (which every later
    step reads). A pair the layout split by a permutation keeps its order."""
    by_node = {step.node: step for step in steps if step.permute is None}
    swapped = {
        activation: pool for activation, pool in pooled.items() if by_node[pool].sources == (activation,)
    }
    pools = {pool: activation for activation, pool in swapped.items()}
    rewritten = []
    for step in steps:
        if step.permute is None and step.node in swapped:
            continue  # it runs after its pool
        if step.permute is None and step.node in pools:
            activation = by_node[pools[step.node]]
            rewritten.append(Step(step.node, activation.sources, step.target))
            rewritten.append(Step(activation.node, (step.target,), step.target))
            continue
        rewritten.append(step)
    return rewritten


def plan_layout(graph: Graph) -> LayoutPlan:
    """Decide once, from each layer type's ``order`` (its row in ``LAYERS``), which order
    each image is kept in: NCHW from the first node that needs it (a convolution, a pooling)
    through every node that works in either order, NHWC again only for a node that needs
    the neutral order (flatten, dense) and for the model's output. Each image is permuted at
    most once (a copy in the other order is shared by every node that reads it)."""
    nchw: dict[int, bool] = {MODEL_INPUT: False}  # value -> whether it is an NCHW image
    other: dict[int, int] = {}  # value -> the key of its copy in the other order
    steps: list[Step] = []

    def read(source: int, want_nchw: bool) -> int:
        if nchw[source] == want_nchw:
            return source
        if source not in other:
            other[source] = MODEL_INPUT - 1 - len(other)
            steps.append(Step(-1, (source,), other[source], to_nchw if want_nchw else to_nhwc))
        return other[source]

    folds = folded_paddings(graph)
    absorbed: dict[int, tuple[int, int]] = {}
    channels_first: list[bool] = []
    for node in graph.nodes:
        if node.index in folds:  # its reader pads instead
            channels_first.append(False)
            continue
        inputs = tuple(graph.nodes[i].inputs[0] if i in folds else i for i in node.inputs)
        absorbed.update((node.index, folds[i]) for i in node.inputs if i in folds)
        order = LAYERS[node.layer.type].order
        if order is Order.CHANNELS_FIRST or order is Order.NEUTRAL:
            first = order is Order.CHANNELS_FIRST
        else:  # EITHER, REDUCES: the inputs' order; NCHW when they differ
            first = any(nchw[source] for source in inputs)
        sources = tuple(
            read(source, first) if _is_image(shape) else source
            for source, shape in zip(inputs, node.input_shapes, strict=True)
        )
        steps.append(Step(node.index, sources, node.index))
        channels_first.append(first)
        nchw[node.index] = first and _is_image(node.output_shape)
    output = read(graph.output, False)
    steps = _pool_before_activation(steps, activations_pooled_first(graph, absorbed))
    return LayoutPlan(tuple(channels_first), tuple(steps), output, absorbed)
