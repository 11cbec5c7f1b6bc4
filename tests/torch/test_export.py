"""``crosstrain export --format torch`` and torch's ``predict``: an ExportedProgram that
runs any number of rows without crosstrain's classes, and a user's native module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosstrain.core.admission.runfolder import write_run_plan
from crosstrain.core.errors import InputError
from crosstrain.core.run.checkpoint import save_checkpoint
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.planfile import load_plan
from crosstrain.inference import export_run, predict_run
from crosstrain.testing.plans import RESNET_PLAN
from tests.conftest import run_cli, user_env

torch = pytest.importorskip("torch")

from crosstrain.backends.torch.strategy import TorchStrategy  # noqa: E402

pytestmark = pytest.mark.torch


def _finished_run(folder: Path, plan_path: Path, weights: dict[str, np.ndarray]) -> Path:
    """A run folder as ``crosstrain run`` leaves it: the plan as run and the final weights."""
    run = folder / "run"
    run.mkdir()
    write_run_plan(run, load_plan(plan_path))
    save_checkpoint(run / "model.safetensors", weights, {"backend": "torch", "step": "0", "plan": "p"})
    return run


#: the resnet reading raw pixels (0..16), scaled as a plan asks: the export applies it too
SCALED_RESNET_PLAN = RESNET_PLAN.replace(
    'source = "digits"', 'source = "digits"\nscale = 0.0625\nmean = 0.25\nstd = 0.5'
)


def test_the_exported_program_runs_any_rows_as_predict_does(tmp_path: Path) -> None:
    """``crosstrain export --format torch``, quiet: batch norm in inference (moved statistics),
    convolutions, a residual block; the program's batch axis is dynamic, and on raw rows its
    outputs are predict's (it scales its input as the plan asks)."""
    (tmp_path / "resnet.toml").write_text(SCALED_RESNET_PLAN)
    plan = load_plan(tmp_path / "resnet.toml")
    weights = dict(initial_weights(plan))
    rng = np.random.default_rng(0)
    for name in weights:  # statistics that are not the identity, as after training
        if name.endswith(("moving_mean", "moving_variance")):
            weights[name] = rng.uniform(0.5, 1.5, weights[name].shape).astype(np.float32)
    run = _finished_run(tmp_path, tmp_path / "resnet.toml", weights)
    exported = run_cli("export", str(run), "--format", "torch", env=user_env())
    program_path, state_path = run / "export-torch" / "model.pt2", run / "export-torch" / "state_dict.pt"
    # the two files, and no warning of torch's about the channels-last kernels it saved
    assert (exported.returncode, exported.stdout.split(), exported.stderr) == (
        0,
        [str(program_path), str(state_path)],
        "",
    )
    program = torch.export.load(str(program_path)).module()
    rows = rng.uniform(0, 16, (37, 64))
    np.save(tmp_path / "rows.npy", rows)
    predicted = predict_run(run, tmp_path / "rows.npy", tmp_path / "out.npy")
    for count in (1, 5, 37):
        x = torch.from_numpy(rows[:count].reshape(count, 8, 8, 1).astype(np.float32))
        assert np.max(np.abs(program(x).detach().numpy() - predicted[:count])) <= 1e-5
    module = TorchStrategy().build(plan, weights).module
    assert sorted(torch.load(str(state_path))) == sorted(module.state_dict())  # torch's own names


def test_a_native_module_exports_for_torch_only(tmp_path: Path) -> None:
    """A user's own nn.Module (found beside its plan, as in training) exports as it is; a
    Keras export of it is refused in one line naming the format."""
    (tmp_path / "native_models.py").write_text(
        "import torch\n"
        "def build(plan):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))\n"
    )
    (tmp_path / "plan.toml").write_text(
        '[model]\ninput_shape = [64]\nnative = { torch = "native_models:build" }\n[data]\nsource = "digits"\n'
    )
    torch.manual_seed(0)
    native = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))
    weights = {name: value.detach().numpy() for name, value in native.state_dict().items()}
    run = _finished_run(tmp_path, tmp_path / "plan.toml", weights)
    with pytest.raises(InputError, match=r"^--format keras: the run's model is a native torch model"):
        export_run(run, "keras")
    program_path, _ = export_run(run, "torch", tmp_path / "exported")
    x = torch.randn(6, 64)
    got = torch.export.load(str(program_path)).module()(x)
    assert torch.allclose(got, native(x), atol=1e-6)
