"""Shape inference and the seeded, framework-free initial weights."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from types import ModuleType
from typing import ClassVar

import attrs
import numpy as np
import pytest

import crosstrain
from crosstrain.core.model import layers
from crosstrain.core.model.graph import build_graph
from crosstrain.core.model.layers import (
    LAYER_TYPES,
    Conv2D,
    Dense,
    Flatten,
    Layer,
    LayerNorm,
    MaxPool2D,
    ReLU,
    Weights,
)
from crosstrain.core.spec.plan_dicts import structure_plan
from tests.conftest import REPO


def infer_shapes(
    input_shape: tuple[int, ...], layers: tuple[Layer, ...] | list[Layer]
) -> list[tuple[int, ...]]:
    return [node.output_shape for node in build_graph(input_shape, layers).nodes]


def init_weights(input_shape: tuple[int, ...], layers: tuple[Layer, ...] | list[Layer], seed: int) -> Weights:
    return build_graph(input_shape, layers).init_weights(seed)


CNN = (Conv2D(filters=6, kernel_size=3), ReLU(), MaxPool2D(), Flatten(), Dense(units=10))


def test_cnn_shapes_flow_channels_last() -> None:
    assert infer_shapes((8, 8, 1), CNN) == [(6, 6, 6), (6, 6, 6), (3, 3, 6), (54,), (10,)]


def test_same_padding_keeps_size() -> None:
    assert infer_shapes((7, 7, 3), [Conv2D(filters=2, kernel_size=3, padding="same")]) == [(7, 7, 2)]


def test_same_padding_at_stride_2_halves_the_size_rounding_up() -> None:
    assert infer_shapes((7, 8, 3), [Conv2D(filters=2, kernel_size=3, strides=2, padding="same")]) == [
        (4, 4, 2)
    ]


def test_kernel_size_and_strides_take_an_int_or_a_pair() -> None:
    layer = Conv2D(filters=4, kernel_size=[3, 1], strides=[2, 1])  # type: ignore[arg-type]
    assert (layer.kernel_size, layer.strides) == ((3, 1), (2, 1))
    assert infer_shapes((9, 5, 2), [layer]) == [(4, 5, 4)]


def test_weights_have_neutral_names_and_layouts() -> None:
    weights = init_weights((8, 8, 1), CNN, seed=0)
    assert set(weights) == {"conv2d_0.kernel", "conv2d_0.bias", "dense_4.kernel", "dense_4.bias"}
    assert weights["conv2d_0.kernel"].shape == (3, 3, 1, 6)  # [kh, kw, in, out]
    assert weights["dense_4.kernel"].shape == (54, 10)  # [in, out]
    assert not weights["dense_4.bias"].any()
    assert all(value.dtype == np.float32 for value in weights.values())


def test_glorot_uniform_bounds() -> None:
    kernel = init_weights((64,), [Dense(units=32)], seed=1)["dense_0.kernel"]
    limit = np.sqrt(6 / (64 + 32))
    assert np.abs(kernel).max() <= limit
    assert np.abs(kernel).max() > 0.9 * limit  # really spread over the range, not tiny


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    first = init_weights((8, 8, 1), CNN, seed=5)
    again = init_weights((8, 8, 1), CNN, seed=5)
    other = init_weights((8, 8, 1), CNN, seed=6)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["dense_4.kernel"], other["dense_4.kernel"])


def test_layernorm_starts_at_identity() -> None:
    weights = init_weights((16,), [LayerNorm()], seed=0)
    assert np.array_equal(weights["layernorm_0.scale"], np.ones(16, np.float32))
    assert not weights["layernorm_0.offset"].any()


# --------------------------------------------------------------------------- one place per layer type


def _families() -> list[ModuleType]:
    """Every module of core/model/layers/ but the base: one family of layer types each."""
    names = (info.name for info in pkgutil.iter_modules(layers.__path__) if info.name != "base")
    return [importlib.import_module(f"{layers.__name__}.{name}") for name in sorted(names)]


def _layer_classes(module: ModuleType) -> set[type[Layer]]:
    return {
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, Layer) and value.__module__ == module.__name__
    }


def test_every_layer_class_registers_itself_and_is_exported() -> None:
    """A layer type is its class in its family's module, named in that module's __all__
    (``crosstrain`` re-exports it, and a type checker reads the list): a class missing from
    LAYER_TYPES, from its family's __all__ or from ``crosstrain`` fails here."""
    public = set()
    for family in _families():
        defined = {cls for cls in _layer_classes(family) if not cls.__name__.startswith("_")}
        assert sorted(family.__all__) == sorted(cls.__name__ for cls in defined), family.__name__
        public |= defined
    assert set(LAYER_TYPES.values()) == public
    assert all(LAYER_TYPES[cls.type] is cls for cls in public)
    assert sorted(layers.__all__) == sorted(cls.__name__ for cls in {*public, Layer})
    assert all(getattr(crosstrain, name) is getattr(layers, name) for name in layers.__all__)
    assert set(layers.__all__) <= set(crosstrain.__all__)


@pytest.fixture
def registry() -> Iterator[dict[str, type[Layer]]]:
    """LAYER_TYPES as it was once the test's classes are gone (they register for good)."""
    before = dict(LAYER_TYPES)
    yield LAYER_TYPES
    LAYER_TYPES.clear()
    LAYER_TYPES.update(before)


def test_a_new_layer_class_registers_itself_and_a_plan_can_name_it(registry: dict[str, type[Layer]]) -> None:
    @attrs.frozen
    class _Gate(Layer):  # a base without a tag of its own: not a plan's layer type
        pass

    @attrs.frozen
    class TestGate(_Gate):  # a tag no real layer type will take
        type: ClassVar[str] = "gate_of_a_test"

    assert registry["gate_of_a_test"] is TestGate
    assert _Gate not in registry.values()
    plan = structure_plan({"model": {"input_shape": [4], "layers": [{"type": "gate_of_a_test"}]}})
    assert plan.model.layers == (TestGate(),)


def test_a_second_class_with_a_tag_already_taken_is_refused_where_it_is_defined(
    registry: dict[str, type[Layer]],
) -> None:
    with pytest.raises(TypeError, match=r"layer type 'dense' of .*MyDense is already taken by .*\.Dense"):

        @attrs.frozen
        class MyDense(Layer):
            type: ClassVar[str] = "dense"

    assert registry["dense"] is Dense


def _documented_types() -> set[str]:
    """The layer types named in the first column of docs/layers.md's table."""
    text = (REPO / "docs" / "layers.md").read_text(encoding="utf-8")
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`(\w+)`", cell)}


def test_every_layer_type_is_specified_in_docs_layers_md() -> None:
    """docs/layers.md says what each layer computes, which every backend implements: a
    type without its row there (or a row for a type that is gone) fails here."""
    assert _documented_types() == set(LAYER_TYPES)
