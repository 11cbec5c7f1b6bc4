"""``model.width``: one number that scales a model's sizes, MobileNet's width multiplier
(alpha) for any plan.

Every size a layer states — a ``dense``'s or an ``embedding``'s ``units``, a convolution's
``filters`` (:data:`SCALED_SIZES`) — becomes ``round(size * width)`` (halves up, at least
1), except the model's **output layer**: the last dense or convolution before the output
(going back through layers that keep their input's size), whose size is the classes, the
vocabulary or the targets' size. Every other layer's size follows its input's, so the
model stays whole: a residual ``add`` still adds equal sizes, a depthwise convolution
(``groups`` = its ``filters``) keeps ``groups`` = its scaled ``filters``. The same model at
width 1 is the plan as written. A plan that a width leaves broken (a ``reshape`` whose
``target_shape`` no longer fits, heads that no longer divide the units) is refused naming
the layer, as any misfit is.

Why a multiplier and not variables: the zoo's plans (``examples/zoo``) must be the
reference architectures as written, with their parameter counts, and train in CI at a
small size; a width and ``model.input_shape`` from ``--set`` scale them down without a
second copy of any plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import MODEL_INPUT, Graph
from crosstrain.core.model.layers import Conv1D, Conv2D, Conv2DTranspose, Dense, Embedding, Layer

#: the layer types whose size ``model.width`` scales, and the field that holds that size;
#: every other layer's output size follows its input's (or is a shape it states itself)
SCALED_SIZES: dict[type[Layer], str] = {
    Dense: "units",
    Embedding: "units",
    Conv2D: "filters",
    Conv1D: "filters",
    Conv2DTranspose: "filters",
}


def scaled_size(size: int, width: float) -> int:
    """``size * width`` rounded half up, at least 1."""
    return max(1, math.floor(size * width + 0.5))


def output_layer_field(graph: Graph) -> str:
    """The plan field of the layer whose size is the model's output size: the last layer
    of :data:`SCALED_SIZES` before the output, through single-input layers only."""
    index = graph.output
    while index != MODEL_INPUT:
        node = graph.nodes[index]
        if type(node.layer) in SCALED_SIZES:
            return node.field
        if len(node.inputs) != 1:
            break
        index = node.inputs[0]
    reached = "the model's input" if index == MODEL_INPUT else f"{graph.nodes[index].layer.type!r}"
    raise PlanError(
        f"going back from the output reaches {reached} before any dense or convolution, so no one "
        "layer's size is the output's; width needs one (width = 1.0 leaves the model as written)",
        field="model.width",
    )


def scale_layers(
    layers: Sequence[Layer],
    blocks: Mapping[str, Sequence[Layer]],
    width: float,
    kept: str,
) -> tuple[tuple[Layer, ...], dict[str, tuple[Layer, ...]]]:
    """The model's layer lists at ``width``: every scaled size but the layer at ``kept``."""

    def scale_list(list_field: str, written: Sequence[Layer]) -> tuple[Layer, ...]:
        return tuple(
            layer if field == kept else _scaled(layer, width, field)
            for field, layer in ((f"{list_field}[{at}]", layer) for at, layer in enumerate(written))
        )

    scaled_blocks = {name: scale_list(f"model.blocks.{name}.layers", block) for name, block in blocks.items()}
    return scale_list("model.layers", layers), scaled_blocks


def _scaled(layer: Layer, width: float, field: str) -> Layer:
    size_field = SCALED_SIZES.get(type(layer))
    if size_field is None:
        return layer
    size = getattr(layer, size_field)
    changes: dict[str, Any] = {size_field: scaled_size(size, width)}
    if size > 1 and getattr(layer, "groups", 1) == size:  # depthwise: one group per channel
        changes["groups"] = changes[size_field]
    try:
        return attrs.evolve(layer, **changes)
    except ValueError as error:  # grouped filters the scaled size no longer splits evenly
        raise PlanError(f"at model.width = {width:g}: {error}", field=field) from None
