"""Plans load from .toml and .py, overrides apply, and every bad field is named."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from crosstrain.core.errors import PlanError
from crosstrain.core.model.layers import Conv2D, Dense
from crosstrain.core.spec.plan import PRECISIONS, WEIGHT_DTYPES, Plan, check_world_fits
from crosstrain.core.spec.plan_dicts import structure_plan, unstructure_plan
from crosstrain.core.spec.planfile import load_plan
from tests.conftest import EXAMPLES, MLP_PLAN, run_cli


def test_example_plan_loads_with_explicit_defaults() -> None:
    plan = load_plan(EXAMPLES / "digits_mlp.toml")
    assert plan.name == "digits_mlp"
    assert isinstance(plan.model.layers[0], Dense)
    assert plan.optimizer.name == "adam"
    assert plan.optimizer.eps == 1e-8  # our default, not a framework's
    assert plan.train.grad_accum_steps == 1


def test_overrides_change_any_field(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan(), ["optimizer.lr=0.01", "train.precision=bf16", "name=renamed"])
    assert plan.optimizer.lr == 0.01
    assert plan.train.precision == "bf16"
    assert plan.name == "renamed"


def test_every_precision_names_the_dtype_of_its_weights(write_plan: Callable[..., Path]) -> None:
    """The one table every backend saves and loads weights by: float32 masters under the
    mixed precisions, float64 only where the whole step is float64."""
    assert tuple(WEIGHT_DTYPES) == PRECISIONS
    assert [name for name, dtype in WEIGHT_DTYPES.items() if dtype == "float64"] == ["fp64"]
    assert load_plan(write_plan(), ["train.precision='fp64'"]).train.weight_dtype == "float64"
    assert load_plan(write_plan(), ["train.precision='bf16'"]).train.weight_dtype == "float32"


def test_overrides_reach_a_list_s_entries(write_plan: Callable[..., Path]) -> None:
    """``model.layers[2].units`` (from 0; negative from the end) and a whole list at once."""
    plan = load_plan(write_plan(), ["model.layers[0].units=16", "model.layers[-1].units=12"])
    assert [getattr(layer, "units", None) for layer in plan.model.layers] == [16, None, 12]
    shape = load_plan(write_plan(), ['model.layers=[{ type = "dense", units = 10 }]']).model.layers
    assert len(shape) == 1


def test_python_plan_loads(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    path.write_text(
        "from crosstrain import Plan, ModelSpec, TrainSpec\n"
        "from crosstrain.core.model.layers import Conv2D, MaxPool2D, Flatten, Dense\n"
        "plan = Plan(name='cnn', model=ModelSpec(input_shape=(8, 8, 1), layers=(\n"
        "    Conv2D(filters=4, kernel_size=3), MaxPool2D(), Flatten(), Dense(units=10))),\n"
        "    train=TrainSpec(global_batch_size=16))\n"
    )
    plan = load_plan(path, ["train.epochs=2"])
    assert isinstance(plan.model.layers[0], Conv2D)
    assert plan.train.epochs == 2 and plan.train.global_batch_size == 16


BAD_FIELDS = [
    ("optimizer.lr=-1", "optimizer.lr"),
    ("optimizer.lr='fast'", "optimizer.lr"),
    ("optimizer.name='rmsprop'", "optimizer.name"),
    ("optimizer.lrr=0.1", "optimizer"),
    ("train.global_batch_size=0", "train.global_batch_size"),
    ("train.epochs=1.5", "train.epochs"),
    ("train.precision='fp8'", "train.precision"),
    ("schedule.name='linear'", "schedule.name"),
    ("data.eval_fraction=1.5", "data.eval_fraction"),
    ("loss.name='hinge'", "loss.name"),
    ("bogus=1", "unknown key"),
    ("model.init=3", "model.init"),
    # a list's entries, by index as errors name them
    ("model.layers[3].units=10", "model.layers[3]: no such entry: the list has 3"),
    ("model.layers[-4].units=10", "model.layers[-4]: no such entry: the list has 3"),
    ("model.layerz[0].units=10", "model.layerz: no such list in the plan"),
    ("model.layers[0].units.x=1", "model.layers[0].units: is not a table"),
    ("model.layers[0]].units=1", "'layers[0]]' is not a key or key[index]"),
    ("model.layers[0].unit=1", "model.layers[0].unit: unknown key; did you mean 'units'?"),
]


@pytest.mark.parametrize(("override", "field"), BAD_FIELDS)
def test_each_bad_field_is_named_with_its_file(
    write_plan: Callable[..., Path], override: str, field: str
) -> None:
    path = write_plan()
    with pytest.raises(PlanError) as caught:
        load_plan(path, [override])
    assert str(path) in str(caught.value)
    assert field in str(caught.value)


def test_a_native_model_cannot_start_from_neutral_weights(write_plan: Callable[..., Path]) -> None:
    with pytest.raises(
        PlanError, match=r"plan\.toml: model\.init: a native model's weights have no neutral names"
    ):
        load_plan(write_plan(), ["model.native={torch='m:f'}", "model.init='init.safetensors'"])


def test_unknown_layer_type_lists_the_known_ones(write_plan: Callable[..., Path]) -> None:
    path = write_plan(MLP_PLAN.replace('type = "relu"', 'type = "capsule"'))
    with pytest.raises(PlanError, match=r"model\.layers\[1\].*unknown layer type 'capsule'.*dense"):
        load_plan(path)


def test_shape_misfit_names_the_layer_and_both_shapes(write_plan: Callable[..., Path]) -> None:
    text = MLP_PLAN.replace('{ type = "relu" }', '{ type = "conv2d", filters = 4, kernel_size = 3 }')
    with pytest.raises(PlanError) as caught:
        load_plan(write_plan(text))
    message = str(caught.value)
    assert "model.layers[1]" in message and "conv2d_1" in message and "[32]" in message


def test_kernel_larger_than_image_is_refused(write_plan: Callable[..., Path]) -> None:
    text = MLP_PLAN.replace("input_shape = [64]", "input_shape = [4, 4, 1]").replace(
        '{ type = "dense", units = 32 }', '{ type = "conv2d", filters = 2, kernel_size = 5 }'
    )
    with pytest.raises(PlanError, match=r"kernel 5 does not fit input shape \[4, 4, 1\]"):
        load_plan(write_plan(text))


def test_batch_must_divide_into_replicas_and_accumulation(write_plan: Callable[..., Path]) -> None:
    plan = load_plan(write_plan(), ["train.grad_accum_steps=2"])
    check_world_fits(plan, 2)  # 32 = 2 x 2 x 8
    with pytest.raises(PlanError, match=r"train.global_batch_size.*replicas \(3\) x grad_accum_steps \(2\)"):
        check_world_fits(plan, 3)


def test_malformed_toml_and_missing_file(tmp_path: Path, write_plan: Callable[..., Path]) -> None:
    with pytest.raises(PlanError, match="not valid TOML"):
        load_plan(write_plan("name = "))
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "absent.toml")


def test_cli_reports_a_bad_plan_in_one_line_with_exit_2(write_plan: Callable[..., Path]) -> None:
    path = write_plan()
    result = run_cli("run", str(path), "--set", "optimizer.momentum=2")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{path}: optimizer.momentum: must be < 1" in result.stderr


def test_plan_is_frozen() -> None:
    plan = load_plan(EXAMPLES / "digits_mlp.toml")
    with pytest.raises(AttributeError):
        plan.seed = 5  # type: ignore[misc]
    assert isinstance(plan, Plan)


def test_the_model_graph_is_built_once_and_stays_out_of_the_spec_s_fields() -> None:
    """Every caller shares one graph; a pickled or plan.json round-tripped spec is the same
    spec, and builds the same graph."""
    plan = load_plan(EXAMPLES / "digits_mlp.toml")
    before = unstructure_plan(plan)
    graph = plan.model.graph()
    assert plan.model.graph(plan.source) is graph
    assert unstructure_plan(plan) == before
    for copy in (pickle.loads(pickle.dumps(plan)), structure_plan(before, plan.source)):
        assert copy == plan
        assert copy.model.graph() is not graph
        assert copy.model.graph() == graph


def test_a_misfit_found_after_loading_names_the_file_each_time(write_plan: Callable[..., Path]) -> None:
    """A spec made without loading is checked when its graph is first asked for; a misfit is
    not kept, so each caller hears of it, under its own file."""
    model = load_plan(write_plan()).model
    layers = (Conv2D(filters=2, kernel_size=5), *model.layers)
    misfit = attrs.evolve(model, layers=layers)
    for source in ("a.toml", "b.toml"):
        with pytest.raises(PlanError, match=rf"^{source}: model\.layers\[0\]: layer 'conv2d_0'"):
            misfit.graph(source)


DID_YOU_MEAN = [
    ("optimzer.lr=0.1", "optimzer: unknown key; did you mean 'optimizer'?"),
    ("data.eval_frac=0.1", "data.eval_frac: unknown key; did you mean 'eval_fraction'?"),
    (
        "model.layers=[{type='dense', units=10, activaton='relu'}]",
        "model.layers[0].activaton: unknown key; did you mean 'activation'?",
    ),
    (
        "model.layers=[{type='MaxPooling2D'}]",
        "model.layers[0]: unknown layer type 'MaxPooling2D'; did you mean 'maxpool2d'?",
    ),
    (
        "model.layers=[{type='dense', units=10, activation='rellu'}]",
        "model.layers[0].activation: must be one of gelu, hard_silu, hard_swish, leaky_relu, linear, relu, "
        "relu6, sigmoid, silu, swish, tanh, got 'rellu'; "
        "did you mean 'relu'?",
    ),
    (
        "model.layers=[{type='dense', units=10, activation='softmax'}]",
        "model.layers[0].activation: must be one of gelu, hard_silu, hard_swish, leaky_relu, linear, relu, "
        "relu6, sigmoid, silu, swish, tanh, got 'softmax': "
        "loss cross_entropy reads logits (Keras's from_logits=True), so the last layer has no activation",
    ),
    ("train.zzz=1", "train.zzz: unknown key (known: clip_grad_norm, compile, cuda_graph, epochs, "),
    # a block's table by its key; a misspelt required key is named as unknown, not missing
    ("model.blocks.res.layer=[{type='relu'}]", "model.blocks.res.layer: unknown key; did you mean 'layers'?"),
]


@pytest.mark.parametrize(("override", "expected"), DID_YOU_MEAN)
def test_an_unknown_name_is_refused_with_the_nearest_known_one(
    write_plan: Callable[..., Path], override: str, expected: str
) -> None:
    path = write_plan()
    with pytest.raises(PlanError) as caught:
        load_plan(path, [override])
    assert str(caught.value).startswith(f"{path}: {expected}")


def test_cli_refuses_a_misspelt_key_in_one_line_naming_it(write_plan: Callable[..., Path]) -> None:
    path = write_plan(MLP_PLAN.replace('{ type = "relu" }', '{ type = "dropout", rates = 0.5 }'))
    result = run_cli("run", str(path))
    assert result.returncode == 2
    assert result.stderr == (
        f"crosstrain: error: {path}: model.layers[1].rates: unknown key; did you mean 'rate'?\n"
    )
