"""The activations: layers of their own, and the names ``activation = NAME`` takes on a dense
layer or a convolution (:data:`ACTIVATIONS`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from crosstrain.core.errors import closest_name
from crosstrain.core.model.layers.base import Layer

#: this module's layer types: what ``crosstrain`` re-exports (a type checker reads this list;
#: it cannot read LAYER_TYPES, which the classes fill as they are defined)
__all__ = [
    "GELU",
    "HardSwish",
    "LeakyReLU",
    "ReLU",
    "ReLU6",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Tanh",
]


def known_activation(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """``activation`` is a name of :data:`ACTIVATIONS` (defined below, beside the layers it
    adds); a name Keras knows that would compute something else here says why not."""
    if value is None or value in ACTIVATIONS:
        return
    reason = NOT_ACTIVATIONS.get(value)
    match = closest_name(value, ACTIVATIONS)
    tail = f": {reason}" if reason else f"; did you mean {match!r}?" if match else ""
    raise ValueError(
        f"'{attribute.name}' must be one of {', '.join(sorted(ACTIVATIONS))}, got {value!r}{tail}"
    )


@attrs.frozen
class Sigmoid(Layer):
    type: ClassVar[str] = "sigmoid"


@attrs.frozen
class SiLU(Layer):
    """``x * sigmoid(x)`` (Keras's silu and swish)."""

    type: ClassVar[str] = "silu"


@attrs.frozen
class Softmax(Layer):
    """Softmax over the last axis (the channels of an image)."""

    type: ClassVar[str] = "softmax"


@attrs.frozen
class ReLU6(Layer):
    """``min(max(x, 0), 6)``; its gradient is 0 at 0 and at 6."""

    type: ClassVar[str] = "relu6"


@attrs.frozen
class HardSwish(Layer):
    """Keras's hard_silu (hard_swish): ``x * (relu6(x + 3) / 6)``, differentiated as that
    expression (relu6's gradient 0 at 0 and 6), so at x = -3 and 3 as Keras, not torch's
    F.hardswish."""

    type: ClassVar[str] = "hard_swish"


@attrs.frozen
class ReLU(Layer):
    type: ClassVar[str] = "relu"


@attrs.frozen
class LeakyReLU(Layer):
    """``x`` where positive, ``negative_slope * x`` elsewhere; the default slope is Keras's
    (0.3), not torch's (0.01)."""

    type: ClassVar[str] = "leaky_relu"
    negative_slope: float = attrs.field(default=0.3, validator=attrs.validators.ge(0.0))


@attrs.frozen
class GELU(Layer):
    """Exact (erf) GELU, the default of both frameworks' functional forms."""

    type: ClassVar[str] = "gelu"


@attrs.frozen
class Tanh(Layer):
    type: ClassVar[str] = "tanh"


#: ``activation = NAME`` on a dense or conv2d layer, as Keras writes it: the layer that
#: :func:`split_activation` puts after it (so every backend builds it with the tables it
#: has). ``leaky_relu`` is Keras's activation function, whose slope is 0.2 (its LeakyReLU
#: *layer*'s, and crosstrain's ``leaky_relu`` layer's default, is 0.3); ``linear`` is none.
ACTIVATIONS: dict[str, Layer | None] = {
    "relu": ReLU(),
    "gelu": GELU(),
    "tanh": Tanh(),
    "leaky_relu": LeakyReLU(negative_slope=0.2),
    "sigmoid": Sigmoid(),
    "silu": SiLU(),
    "swish": SiLU(),  # Keras's other name for silu
    "relu6": ReLU6(),
    "hard_swish": HardSwish(),
    "hard_silu": HardSwish(),  # Keras's other name for hard_swish
    "linear": None,
}


#: activation names Keras knows that are refused with the reason, rather than as unknown
NOT_ACTIVATIONS = {
    "softmax": "loss cross_entropy reads logits (Keras's from_logits=True), so the last layer "
    "has no activation",
}
