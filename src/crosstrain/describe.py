"""``crosstrain describe PLAN``: the model as a table, without starting any framework.

Keras's ``model.summary()`` for a neutral plan: each node of the graph (blocks expanded,
one row per repeat's layer) with its output shape and parameters (a dense tied to an
embedding counts none for the table it shares), then the totals and the
forward FLOPs of one row (2 x multiply-adds of dense, convolution and attention; the
elementwise work is left out, as most summaries do).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table
from rich.text import Text

from crosstrain.core.model.graph import MODEL_INPUT, Graph
from crosstrain.core.spec.plan import Plan


@attrs.frozen
class LayerRow:
    name: str
    type: str
    inputs: str
    output_shape: tuple[int, ...]
    parameters: int
    trainable: int


@attrs.frozen
class ModelDescription:
    rows: tuple[LayerRow, ...]
    input_shape: tuple[int, ...]
    input_dtype: str
    flops_per_row: int

    @property
    def parameters(self) -> int:
        return sum(row.parameters for row in self.rows)

    @property
    def trainable(self) -> int:
        return sum(row.trainable for row in self.rows)


def describe_graph(graph: Graph) -> ModelDescription:
    names = {MODEL_INPUT: "input", **{node.index: node.path for node in graph.nodes}}
    rows = []
    for node in graph.nodes:
        specs = node.weight_specs()
        sizes = {name: math.prod(spec.shape) for name, spec in specs.items()}
        previous = node.index - 1 if node.index > 0 else MODEL_INPUT
        inputs = "" if node.inputs == (previous,) else ", ".join(names[i] for i in node.inputs)
        tied = "" if node.tied_to is None else f" (tied to {graph.nodes[node.tied_to].path})"
        rows.append(
            LayerRow(
                name=node.path,
                type=node.layer.type + tied,
                inputs=inputs,
                output_shape=node.output_shape,
                parameters=sum(sizes.values()),
                trainable=sum(size for name, size in sizes.items() if specs[name].trainable),
            )
        )
    return ModelDescription(tuple(rows), graph.input_shape, graph.input_dtype, graph.forward_flops_per_row)


def _count(value: int) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value:,} ({value / limit:.2f} {suffix})"
    return f"{value:,}"


def print_description(console: Console, plan: Plan) -> None:
    if plan.model.native is not None:
        factories = ", ".join(f"{backend}: {target}" for backend, target in plan.model.native.factories)
        console.print(Text(f"{plan.name}: a native model ({factories}); its layers are the framework's own"))
        return
    description = describe_graph(plan.model.graph(plan.source))
    width = f", width {plan.model.width:g}" if plan.model.width != 1.0 else ""
    shown = f"{list(description.input_shape)} {description.input_dtype}{width}"
    table = Table(title=f"{plan.name}: input {shown}")
    for column, justify in (
        ("layer", "left"),
        ("type", "left"),
        ("inputs", "left"),
        ("output", "left"),
        ("params", "right"),
    ):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in description.rows:
        cells: tuple[Any, ...] = (
            row.name,
            row.type,
            row.inputs,
            str(list(row.output_shape)),
            f"{row.parameters:,}",
        )
        table.add_row(*(Text(str(cell)) for cell in cells))
    console.print(table)
    console.print(f"parameters: {_count(description.parameters)}, trainable {_count(description.trainable)}")
    console.print(f"forward FLOPs per row: {_count(description.flops_per_row)}")
