"""A plan's model as a flat graph of nodes: names, ``inputs``, blocks and repeats resolved.

Backends build from :class:`Graph` alone: each node is one layer with its inputs (earlier
nodes, or the model input), shapes, its neutral weight prefix and the plan field it came
from. Every error names that field (``model.blocks.decoder.layers[1]``), so a misfit is
reported before any process starts.

Weight names: a top-level layer's are ``{name}.{param}`` (``dense_0.kernel``); a layer
inside a block gets the block layer's name and the repeat as prefix
(``decoder_2.0.att.query_kernel``). Each node draws its initial weights from its own
stream ``(seed, index path)``, so adding a layer later does not change earlier weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np

from crosstrain.core.errors import PlanError
from crosstrain.core.model.layers import (
    Block,
    Dense,
    DType,
    Embedding,
    Layer,
    Shape,
    Weights,
    WeightSpec,
    layer_name,
)
from crosstrain.core.model.layers.dense import split_activation

#: the node index that stands for the model's input
MODEL_INPUT = -1
#: the name by which a layer list refers to its own input
INPUT_NAME = "input"


@attrs.frozen
class Node:
    """One layer in the flattened graph."""

    index: int  # position in the graph; also dropout's per-layer counter
    path: str  # neutral weight prefix
    layer: Layer
    inputs: tuple[int, ...]  # node indices, MODEL_INPUT for the model input
    input_shapes: tuple[Shape, ...]
    output_shape: Shape
    field: str  # the plan field this node comes from
    seed_path: tuple[int, ...]
    #: a dense layer's ``tie``: the embedding node whose table, transposed, is its kernel
    tied_to: int | None = None

    @property
    def input_shape(self) -> Shape:
        return self.input_shapes[0]

    def weight_specs(self) -> dict[str, WeightSpec]:
        return self.layer.weight_specs(self.input_shape) if self.layer.arity == 1 else {}

    def initial_weights(self, seed: int) -> Weights:
        """This node's seeded weights, ``{path}.{param}``, from its own stream."""
        rng = np.random.default_rng([seed, *self.seed_path])
        return {f"{self.path}.{param}": spec.initial(rng) for param, spec in self.weight_specs().items()}


@attrs.frozen
class Graph:
    input_shape: Shape
    input_dtype: DType
    nodes: tuple[Node, ...]
    output: int  # the node whose value is the model's output

    @property
    def forward_flops_per_row(self) -> int:
        """The forward FLOPs of one row: 2 x the multiply-adds of dense, convolution and
        attention (the elementwise work left out, as most summaries and MFU figures do)."""
        return sum(
            2 * node.layer.multiply_adds(node.input_shape) for node in self.nodes if node.layer.arity == 1
        )

    @property
    def output_shape(self) -> Shape:
        return self.input_shape if self.output == MODEL_INPUT else self.nodes[self.output].output_shape

    def tied_table(self, node: Node) -> str | None:
        """The neutral name of the embedding table a tied dense node uses as its kernel
        (transposed), or None for every other node."""
        return None if node.tied_to is None else f"{self.nodes[node.tied_to].path}.table"

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every weight of the model, ``{path}.{param}`` -> spec, in node order."""
        return {
            f"{node.path}.{param}": spec for node in self.nodes for param, spec in node.weight_specs().items()
        }

    def block_repeats(self) -> list[tuple[Node, ...]]:
        """The nodes of each repeat of a top-level block, in graph order (a nested block's
        nodes within its outer repeat): the units a sharded backend gathers one at a time.
        A repeat is contiguous in the graph, and a ``tie`` names an embedding of its own
        list, so tied weights stay within one repeat, or outside every one."""
        repeats: dict[str, list[Node]] = {}
        for node in self.nodes:
            if node.field.startswith("model.blocks."):  # path: "{block}.{repeat}.{layer}..."
                block, repeat, _ = node.path.split(".", 2)
                repeats.setdefault(f"{block}.{repeat}", []).append(node)
        return [tuple(nodes) for nodes in repeats.values()]

    def init_weights(self, seed: int) -> Weights:
        """Seeded numpy weights, identical for every backend."""
        return {name: value for node in self.nodes for name, value in node.initial_weights(seed).items()}

    def seeded_weights(self, seed: int) -> SeededWeights:
        """:meth:`init_weights`, each node's made only when one of its weights is read."""
        return SeededWeights(self.nodes, seed)


class SeededWeights(Mapping[str, np.ndarray]):
    """A graph's seeded starting weights, made a node at a time as they are read: a run
    that keeps a shard of each weight never holds every whole weight at once (read in
    order, at most one node's beyond what the reader keeps). Each node draws from its own
    stream, so a weight is the same whichever order they are read in."""

    def __init__(self, nodes: Sequence[Node], seed: int) -> None:
        self._seed = seed
        self._owner = {f"{node.path}.{param}": node for node in nodes for param in node.weight_specs()}
        self._made: tuple[Node | None, Weights] = (None, {})

    def __getitem__(self, name: str) -> np.ndarray:
        node = self._owner[name]
        if self._made[0] is not node:  # the last node's weights stay, for its next reads
            self._made = (node, node.initial_weights(self._seed))
        return self._made[1][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)


@attrs.frozen
class _ListPlace:
    """Where a layer list sits: its field prefix, weight prefix and seed prefix."""

    field: str
    path: str
    seed_path: tuple[int, ...]


class _Builder:
    def __init__(
        self,
        input_shape: Shape,
        input_dtype: DType,
        blocks: Mapping[str, Sequence[Layer]],
    ) -> None:
        self.blocks = blocks
        self.nodes: list[Node] = []
        self.shapes: dict[int, Shape] = {MODEL_INPUT: tuple(input_shape)}
        self.dtypes: dict[int, DType] = {MODEL_INPUT: input_dtype}

    def error(self, message: str, field: str) -> PlanError:
        return PlanError(message, field=field)

    def run_list(
        self,
        layers: Sequence[Layer],
        list_input: int,
        place: _ListPlace,
        stack: tuple[str, ...],
        side: Mapping[str, int] | None = None,
    ) -> int:
        """Add the list's nodes; return the node holding the list's output. ``side``: a
        block's side inputs, by the names its layers read them under."""
        named: dict[str, int] = {INPUT_NAME: list_input, **(side or {})}
        shifted: dict[str, str] = {}  # default names that count added activations -> field
        previous = list_input
        for position, entry in enumerate(expand_activations(layers, place.field)):
            field = entry.field
            name = layer_name(entry.layer, position)
            if name in named:
                raise self.error(f"the name {name!r} is used twice in this list", f"{field}.name")
            inputs = self._resolve_inputs(entry.layer, named, shifted, previous, field)
            if isinstance(entry.layer, Block):
                side = (
                    dict(zip(entry.layer.inputs[1:], inputs[1:], strict=True)) if entry.layer.inputs else {}
                )
                previous = self._run_block(entry.layer, name, inputs[0], place, position, field, stack, side)
            else:
                tied_to = self._resolve_tie(entry.layer, named, field)
                previous = self._add_node(entry.layer, name, inputs, place, position, field, tied_to)
            named[name] = previous
            if entry.layer.name is None and entry.listed_at != position:
                shifted[name] = field
            if entry.added:  # Keras's meaning: a layer's output is after its activation
                named[layer_name(layers[entry.listed_at], position - 1)] = previous
        return previous

    def _resolve_inputs(
        self, layer: Layer, named: dict[str, int], shifted: dict[str, str], previous: int, field: str
    ) -> tuple[int, ...]:
        if layer.inputs is None:
            if layer.arity is None:
                raise self.error(
                    f"{layer.type} needs inputs = [names of two or more layers]", f"{field}.inputs"
                )
            return (previous,)
        unknown = [name for name in layer.inputs if name not in named]
        if unknown:
            known = ", ".join(named)
            raise self.error(
                f"no earlier layer named {unknown[0]!r} in this list (known: {known})", f"{field}.inputs"
            )
        ambiguous = [name for name in layer.inputs if name in shifted]
        if ambiguous:
            # the written list's positions and the default names differ from here on: a
            # reference by default name could mean either layer, so it means none
            raise self.error(
                f"{ambiguous[0]!r} is the default name of {shifted[ambiguous[0]]}, which counts an "
                "earlier layer's activation as a layer of its own; name the layer you mean "
                "(name = ...) and use that name",
                f"{field}.inputs",
            )
        if layer.arity is not None and not (
            layer.arity <= len(layer.inputs) <= layer.arity + len(layer.optional_inputs)
        ):
            optional = (
                f" (then optionally {', '.join(layer.optional_inputs)})" if layer.optional_inputs else ""
            )
            raise self.error(
                f"{layer.type} takes {layer.arity} input{optional}, got {len(layer.inputs)}",
                f"{field}.inputs",
            )
        return tuple(named[name] for name in layer.inputs)

    def _resolve_tie(self, layer: Layer, named: dict[str, int], field: str) -> int | None:
        """A dense layer's ``tie``: the embedding node of that name in this list, whose table
        [vocab_size, units] must be the transposed kernel's shape."""
        if not isinstance(layer, Dense) or layer.tie is None:
            return None
        index = named.get(layer.tie, MODEL_INPUT)
        node = self.nodes[index] if index != MODEL_INPUT else None
        # the embedding's own name: a block's name stands for the block's last node
        if node is None or not isinstance(node.layer, Embedding) or node.path.rsplit(".", 1)[-1] != layer.tie:
            raise self.error(
                f"tie names {layer.tie!r}, but no earlier embedding layer of this list has that name",
                f"{field}.tie",
            )
        tied = node.layer
        if layer.units != tied.vocab_size:
            raise self.error(
                f"a dense tied to {layer.tie!r} has units = its vocab_size ({tied.vocab_size}), "
                f"got {layer.units}",
                f"{field}.units",
            )
        return index

    def _add_node(
        self,
        layer: Layer,
        name: str,
        inputs: tuple[int, ...],
        place: _ListPlace,
        position: int,
        field: str,
        tied_to: int | None = None,
    ) -> int:
        for source in inputs:
            if self.dtypes[source] not in layer.accepts:
                raise self.error(_dtype_problem(layer, self.dtypes[source]), field)
        input_shapes = tuple(self.shapes[source] for source in inputs)
        try:
            output_shape = tuple(layer.merged_shape(input_shapes))
        except ValueError as error:
            raise self.error(f"layer {name!r}: {error}", field) from None
        if tied_to is not None and input_shapes[0][-1] != self.nodes[tied_to].output_shape[-1]:
            raise self.error(
                f"layer {name!r} reads {input_shapes[0][-1]} features, but the embedding it is tied "
                f"to has {self.nodes[tied_to].output_shape[-1]} units",
                f"{field}.tie",
            )
        node = Node(
            index=len(self.nodes),
            path=f"{place.path}{name}",
            layer=layer,
            inputs=inputs,
            input_shapes=input_shapes,
            output_shape=output_shape,
            field=field,
            seed_path=(*place.seed_path, position),
            tied_to=tied_to,
        )
        self.nodes.append(node)
        self.shapes[node.index] = output_shape
        self.dtypes[node.index] = "float32"
        return node.index

    def _run_block(
        self,
        layer: Block,
        name: str,
        list_input: int,
        place: _ListPlace,
        position: int,
        field: str,
        stack: tuple[str, ...],
        side: Mapping[str, int],
    ) -> int:
        """Each repeat reads the one before (its ``"input"``); the side inputs, every repeat
        the same, under their names in the block layer's ``inputs``."""
        if layer.block not in self.blocks:
            known = ", ".join(sorted(self.blocks)) or "none defined"
            raise self.error(f"no block {layer.block!r} in model.blocks ({known})", f"{field}.block")
        if layer.block in stack:
            raise self.error(f"block {layer.block!r} contains itself", f"{field}.block")
        output = list_input
        for repeat in range(layer.repeat):
            inner = _ListPlace(
                field=f"model.blocks.{layer.block}.layers",
                path=f"{place.path}{name}.{repeat}.",
                seed_path=(*place.seed_path, position, repeat),
            )
            output = self.run_list(self.blocks[layer.block], output, inner, (*stack, layer.block), side)
        return output


def _dtype_problem(layer: Layer, dtype: DType) -> str:
    if dtype == "int32":
        return (
            f"{layer.type} cannot read integer token ids (model.input_dtype = 'int32'): "
            "start with an embedding"
        )
    return f"{layer.type} reads integer token ids: set model.input_dtype = 'int32'"


def build_graph(
    input_shape: Shape,
    layers: Sequence[Layer],
    blocks: Mapping[str, Sequence[Layer]] | None = None,
    input_dtype: DType = "float32",
) -> Graph:
    """Resolve names, inputs and blocks into a flat graph; check every shape on the way (a
    misfit's error names its field; the plan adds its file)."""
    builder = _Builder(tuple(input_shape), input_dtype, blocks or {})
    output = builder.run_list(layers, MODEL_INPUT, _ListPlace("model.layers", "", ()), ())
    if builder.dtypes[output] != "float32":
        raise builder.error("the model must turn token ids into values (add an embedding)", "model.layers")
    return Graph(tuple(input_shape), input_dtype, tuple(builder.nodes), output)


@attrs.frozen
class ListEntry:
    """One layer of a list as the graph reads it: a written layer, or the activation layer
    that a written layer's ``activation`` adds after it."""

    layer: Layer
    field: str  # the plan field it comes from
    listed_at: int  # the written layer's position in the list
    added: bool = False  # the activation of the entry before it


def expand_activations(layers: Sequence[Layer], list_field: str) -> Iterator[ListEntry]:
    """The list with each ``activation = NAME`` written out as the layer it names, right
    after its layer: ``dense activation=relu`` is ``dense``, ``relu`` to every backend, with
    the same weights, names, initial values and dropout masks (default names and seeds
    count list positions, the added activation's too)."""
    for listed_at, written in enumerate(layers):
        layer, activation = split_activation(written)
        field = f"{list_field}[{listed_at}]"
        yield ListEntry(layer, field, listed_at)
        if activation is not None:
            yield ListEntry(activation, f"{field}.activation", listed_at, added=True)


def dense_on_image(graph: Graph) -> Node | None:
    """The first dense node that reads an image ([height, width, channels]): where a flatten
    was most likely forgotten."""
    for node in graph.nodes:
        if isinstance(node.layer, Dense) and len(node.input_shape) == 3:
            return node
    return None


def iter_layers(
    layers: Sequence[Layer], blocks: Mapping[str, Sequence[Layer]]
) -> Iterator[tuple[str, Layer]]:
    """Every (field, layer) of a model once, blocks and added activations included: what a
    vocabulary check walks."""
    lists = [("model.layers", layers)]
    lists += [(f"model.blocks.{block}.layers", block_layers) for block, block_layers in blocks.items()]
    for list_field, list_layers in lists:
        for entry in expand_activations(list_layers, list_field):
            yield entry.field, entry.layer
