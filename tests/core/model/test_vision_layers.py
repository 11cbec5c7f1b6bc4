"""The convolution family and the element-wise and shape layers: shapes, TensorFlow's
'same' padding, weights and refusals, with no framework (each backend's numbers are the
per-op parity cases of crosstrain.testing.layer_cases)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import build_graph
from crosstrain.core.model.layers import (
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Crop2D,
    Dense,
    HardSwish,
    Layer,
    LayerScale,
    Mean,
    Multiply,
    ReLU6,
    Reshape,
    Sigmoid,
    SiLU,
    Transpose,
    UpSample2D,
    ZeroPad2D,
)
from crosstrain.core.model.layers.convolutions import same_padding
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan
from crosstrain.core.spec.planfile import load_plan


def shapes(input_shape: tuple[int, ...], *layers: Layer) -> list[tuple[int, ...]]:
    return [node.output_shape for node in build_graph(input_shape, layers).nodes]


def model(layers: str, input_shape: str = "[8, 8, 4]") -> str:
    return f"[model]\ninput_shape = {input_shape}\nlayers = [\n{layers}\n]\n"


@pytest.mark.parametrize(
    ("size", "window", "stride", "pads"),
    [
        (8, 3, 2, (0, 1)),  # odd total: the extra row after (bottom, right), as TensorFlow
        (7, 3, 2, (1, 1)),
        (6, 4, 1, (1, 2)),  # an even kernel at stride 1 too
        (8, 1, 2, (0, 0)),
        (5, 5, 3, (1, 2)),
    ],
)
def test_same_padding_is_tensorflows(size: int, window: int, stride: int, pads: tuple[int, int]) -> None:
    assert same_padding(size, window, stride) == pads


def test_conv2d_same_at_stride_2_dilation_and_groups() -> None:
    strided = Conv2D(filters=6, kernel_size=3, strides=2, padding="same")
    assert strided.paddings((8, 7, 4)) == ((0, 1), (1, 1))
    dilated = Conv2D(filters=4, kernel_size=3, dilation=2, padding="valid")
    assert shapes((9, 8, 4), dilated) == [(5, 4, 4)]  # a 5x5 window
    depthwise = Conv2D(filters=8, kernel_size=3, strides=2, padding="same", groups=4)
    graph = build_graph((8, 8, 4), [depthwise])
    assert graph.nodes[0].output_shape == (4, 4, 8)
    assert graph.weight_specs()["conv2d_0.kernel"].shape == (3, 3, 1, 8)  # [kh, kw, in / groups, out]
    assert depthwise.multiply_adds((8, 8, 4)) == 4 * 4 * 9 * 1 * 8


def test_groups_that_do_not_divide_the_channels_are_refused_naming_the_field(
    write_plan: Callable[..., Path],
) -> None:
    text = model('{ type = "conv2d", filters = 6, kernel_size = 3, groups = 3 }')
    with pytest.raises(
        PlanError, match=r"model.layers\[0\]: layer 'conv2d_0': groups = 3 does not divide the 4 "
    ):
        load_plan(write_plan(text))
    with pytest.raises(PlanError, match=r"model.layers\[0\].*groups = 4 does not divide filters = 6"):
        load_plan(write_plan(model('{ type = "conv2d", filters = 6, kernel_size = 3, groups = 4 }')))
    with pytest.raises(
        PlanError, match=r"model.layers\[0\].*strides \[2, 2\] > 1 with dilation \[2, 2\] > 1"
    ):
        load_plan(
            write_plan(model('{ type = "conv2d", filters = 4, kernel_size = 3, strides = 2, dilation = 2 }'))
        )


def test_a_conv2d_plan_without_dilation_or_groups_is_written_as_before(
    write_plan: Callable[..., Path],
) -> None:
    """plan.json (what a resumed run's hash reads) leaves dilation and groups out at their
    defaults, so a run from before they existed still resumes; set, they round-trip."""
    plain = unstructure_plan(
        load_plan(write_plan(model('{ type = "conv2d", filters = 4, kernel_size = 3 }')))
    )
    assert plain["model"]["layers"] == [
        {
            "type": "conv2d",
            "filters": 4,
            "kernel_size": (3, 3),
            "strides": (1, 1),
            "padding": "valid",
            "use_bias": True,
        }
    ]
    grouped = load_plan(
        write_plan(model('{ type = "conv2d", filters = 4, kernel_size = 3, dilation = [2, 1], groups = 2 }'))
    )
    assert structure_plan(unstructure_plan(grouped)) == grouped
    assert grouped.model.layers[0] == Conv2D(filters=4, kernel_size=3, dilation=(2, 1), groups=2)


def test_conv1d_reads_a_sequence() -> None:
    layer = Conv1D(filters=6, kernel_size=3, strides=2, padding="same", groups=2)
    assert shapes((10, 4), layer) == [(5, 6)]
    assert layer.paddings((10, 4)) == (0, 1)
    assert build_graph((10, 4), [layer]).weight_specs()["conv1d_0.kernel"].shape == (3, 2, 6)
    with pytest.raises(PlanError, match=r"conv1d expects a sequence \[length, channels\]"):
        build_graph((8, 8, 4), [layer])


@pytest.mark.parametrize(
    ("kernel", "strides", "padding", "size", "crops"),
    [
        (3, 2, "same", (8, 10), ((0, 0), (0, 0))),  # in x stride; starts where a same conv pads
        (4, 2, "same", (8, 10), ((1, 0), (1, 0))),
        (3, 2, "valid", (9, 11), ((0, 0), (0, 0))),  # (in - 1) x stride + kernel
        (1, 2, "valid", (8, 10), ((0, 1), (0, 1))),  # (in - 1) x stride + max(kernel, stride)
    ],
)
def test_conv2d_transpose_sizes_are_keras(
    kernel: int, strides: int, padding: str, size: tuple[int, int], crops: tuple[tuple[int, int], ...]
) -> None:
    layer = Conv2DTranspose(filters=2, kernel_size=kernel, strides=strides, padding=padding)  # type: ignore[arg-type]
    assert shapes((4, 5, 3), layer) == [(*size, 2)]
    assert layer.crops((4, 5, 3)) == crops
    kernel_shape = build_graph((4, 5, 3), [layer]).weight_specs()["conv2d_transpose_0.kernel"].shape
    assert kernel_shape == (kernel, kernel, 2, 3)  # [kh, kw, out, in], Keras's


def test_upsample_and_zero_padding(write_plan: Callable[..., Path]) -> None:
    assert shapes((3, 4, 2), UpSample2D(size=(2, 3), interpolation="bilinear")) == [(6, 12, 2)]
    assert shapes((3, 4, 2), ZeroPad2D(padding=((1, 0), (2, 1)))) == [(4, 7, 2)]
    forms = {"2": ((2, 2), (2, 2)), "[1, 2]": ((1, 1), (2, 2)), "[[1, 0], [0, 3]]": ((1, 0), (0, 3))}
    for written, padding in forms.items():
        plan = load_plan(write_plan(model(f'{{ type = "zero_pad2d", padding = {written} }}')))
        assert plan.model.layers[0] == ZeroPad2D(padding=padding)
        assert structure_plan(unstructure_plan(plan)) == plan
    bicubic = model('{ type = "upsample2d", interpolation = "bicubic" }')
    reason = r"got 'bicubic': torch's bicubic kernel \(a = -0.75\) is not tf.image.resize's"
    with pytest.raises(PlanError, match=r"model.layers\[0\].interpolation: must be one of .*" + reason):
        load_plan(write_plan(bicubic))
    with pytest.raises(PlanError, match=r"must be one of 'nearest', 'bilinear', got 'cubic'$"):
        load_plan(write_plan(model('{ type = "upsample2d", interpolation = "cubic" }')))
    with pytest.raises(PlanError, match=r"model.layers\[0\].*padding.*must be >= 0"):
        load_plan(write_plan(model('{ type = "zero_pad2d", padding = [1, -1] }')))


def test_crop2d_removes_rows_and_columns(write_plan: Callable[..., Path]) -> None:
    assert shapes((5, 6, 2), Crop2D(cropping=((1, 0), (2, 1)))) == [(4, 3, 2)]
    plan = load_plan(write_plan(model('{ type = "crop2d", cropping = [[0, 1], [1, 0]] }')))
    assert plan.model.layers[0] == Crop2D(cropping=((0, 1), (1, 0)))
    assert plan.model.graph().nodes[0].output_shape == (7, 7, 4)
    assert structure_plan(unstructure_plan(plan)) == plan
    with pytest.raises(
        PlanError, match=r"cropping \[\[4, 4\], \[1, 1\]\] leaves nothing of input shape \[8, 8, 4\]"
    ):
        load_plan(write_plan(model('{ type = "crop2d", cropping = [4, 1] }')))


def test_scale_learns_one_multiplier_per_feature_from_its_start() -> None:
    graph = build_graph((4, 4, 3), [LayerScale(initial=1e-6)])
    assert graph.nodes[0].output_shape == (4, 4, 3)
    spec = graph.weight_specs()["layer_scale_0.scale"]
    assert (spec.shape, spec.trainable, spec.kernel) == ((3,), True, False)
    assert spec.initial(np.random.default_rng(0)).tolist() == [np.float32(1e-6)] * 3


def test_multiply_broadcasts_sizes_of_1_only() -> None:
    gate = (Dense(units=4, name="x"), Mean(axes=(0, 1), keepdims=True, name="gate"))
    assert shapes((5, 6, 3), *gate, Multiply(inputs=("x", "gate")))[-1] == (5, 6, 4)
    with pytest.raises(
        PlanError, match=r"sizes that agree or are 1 on each axis, got \[\[5, 6, 4\], \[5, 6, 3\]\]"
    ):
        build_graph((5, 6, 3), [Dense(units=4, name="x"), Multiply(inputs=("x", "input"))])
    with pytest.raises(PlanError, match="multiply needs inputs of one rank"):
        build_graph((5, 6, 3), [Mean(axes=(0, 1), name="m"), Multiply(inputs=("m", "input"))])


def test_reshape_transpose_and_mean() -> None:
    assert shapes((3, 4, 2), Reshape(target_shape=(-1, 4))) == [(6, 4)]
    assert shapes((5, 6), Transpose(perm=(1, 0))) == [(6, 5)]
    assert shapes((4, 3, 5), Mean(axes=(0, -1))) == [(3,)]
    assert shapes((4, 3, 5), Mean(axes=(1,), keepdims=True)) == [(4, 1, 5)]
    with pytest.raises(PlanError, match=r"reshape cannot make \[5, -1\] of input shape \[3, 4, 2\]"):
        build_graph((3, 4, 2), [Reshape(target_shape=(5, -1))])
    with pytest.raises(ValueError, match="at most one -1"):
        Reshape(target_shape=(-1, -1))
    with pytest.raises(PlanError, match=r"perm \[0, 0\] is not an order of the axes"):
        build_graph((5, 6), [Transpose(perm=(0, 0))])
    with pytest.raises(PlanError, match=r"axes \[0, 3\] are not distinct axes of input shape \[4, 3, 5\]"):
        build_graph((4, 3, 5), [Mean(axes=(0, 3))])
    with pytest.raises(PlanError, match=r"axes \[0, -3\] are not distinct axes"):
        build_graph((4, 3, 5), [Mean(axes=(0, -3))])


def test_the_new_activation_names_are_their_layers(write_plan: Callable[..., Path]) -> None:
    names = {
        "sigmoid": Sigmoid(),
        "silu": SiLU(),
        "swish": SiLU(),
        "relu6": ReLU6(),
        "hard_swish": HardSwish(),
    }
    for name, layer in names.items():
        graph = load_plan(
            write_plan(
                model(f'{{ type = "conv1d", filters = 2, kernel_size = 3, activation = "{name}" }}', "[6, 2]")
            )
        ).model.graph()
        assert [node.layer for node in graph.nodes] == [Conv1D(filters=2, kernel_size=3), layer]
    with pytest.raises(PlanError, match=r"softmax.*loss cross_entropy reads logits"):
        load_plan(write_plan(model('{ type = "dense", units = 3, activation = "softmax" }', "[6]")))
