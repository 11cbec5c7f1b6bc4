"""``crosstrain export --format torch``: an ExportedProgram (``torch.export.save``) and the
module's state_dict.

Why torch.export rather than generated source or TorchScript: the ExportedProgram holds
the graph as ATen operations with the weights inside, so ``torch.export.load`` needs
neither crosstrain nor the module's class (a user's native module included); TorchScript
would script crosstrain's layer classes, and generated source would be a second copy of
every layer to keep in step. The batch axis is dynamic: any number of rows.

The program takes the raw rows ``crosstrain predict`` takes: it begins with the plan's
input scaling (``data.scale``/``mean``/``std``), the same float32 operations training
applies on the device. ``state_dict.pt`` is the module's weights alone.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from crosstrain.backends.torch.feed import scaler
from crosstrain.core.data.scaling import InputScaling
from crosstrain.core.errors import InputError

PROGRAM_FILE = "model.pt2"
STATE_DICT_FILE = "state_dict.pt"
#: largest difference between the exported program's outputs and the module's
TOLERANCE = 1e-5


class _Inference(nn.Module):
    """The model in inference mode, called with its raw input alone: scaled as in training,
    then the model (a neutral GraphModule's row mask, positions and step are for training
    only)."""

    def __init__(self, module: nn.Module, scaling: InputScaling) -> None:
        super().__init__()
        self.module = module
        self.scale = None if scaling.is_identity else scaler(scaling, torch.device("cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            x = self.scale(x)
        return self.module(x).float()  # type: ignore[no-any-return]


def export_torch(module: nn.Module, scaling: InputScaling, out: Path, sample: np.ndarray) -> list[Path]:
    """Write ``model.pt2`` and ``state_dict.pt`` under ``out``; check the program's outputs
    on ``sample`` (raw rows) against the module's on the scaled rows."""
    wrapper = _Inference(copy.deepcopy(module).cpu().eval(), scaling)
    example = torch.from_numpy(np.ascontiguousarray(sample))
    rows = torch.export.Dim("rows", min=1)
    try:
        program = torch.export.export(wrapper, (example,), dynamic_shapes={"x": {0: rows}})
    except Exception as error:  # a user's native module may hold what torch.export cannot trace
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"--format torch: torch.export cannot capture this model: {first}") from None
    out.mkdir(parents=True, exist_ok=True)
    program_path, state_path = out / PROGRAM_FILE, out / STATE_DICT_FILE
    with warnings.catch_warnings():
        # torch's archive writer calls every non-contiguous weight (a convolution's kernel is
        # channels-last) "incomplete" and warns, then saves it whole, as it is
        warnings.filterwarnings("ignore", "No complete tensor found in the group", UserWarning)
        torch.export.save(program, str(program_path))
    torch.save(wrapper.module.state_dict(), str(state_path))
    _check(program_path, wrapper, example)
    return [program_path, state_path]


def _check(path: Path, wrapper: nn.Module, example: torch.Tensor) -> None:
    """The saved program, loaded back, computes what the module does."""
    loaded = torch.export.load(str(path)).module()
    with torch.no_grad():
        expected, got = wrapper(example), loaded(example)
    difference = float((expected - got).abs().max()) if expected.numel() else 0.0
    if difference > TOLERANCE:
        path.unlink()
        raise InputError(
            f"--format torch: the exported program differs from the model by {difference:.3g} "
            f"(more than {TOLERANCE:g}); nothing was written"
        )
