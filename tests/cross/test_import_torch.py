"""`crosstrain import module:factory --framework torch`: a torch module traced with torch.fx
becomes a plan whose forward on torch and on tf is the module's (a ResNet-style and a
transformer-style module, NCHW images read as the plan's NHWC), a call without a plan
equivalent is refused in one line, and an imported plan trains from its weights on both
backends alike, through the CLI.

The modules' weights are drawn off torch's start (batch norm's running statistics
included) so that every weight matters; the forward checks run in this process on the
backends' own predict (inference mode) from the weights the import wrote.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crosstrain.core.run.loading import load_datasets
from crosstrain.core.spec.planfile import load_plan
from crosstrain.testing.imported import FORWARD_TOLERANCE, plan_outputs, relative_difference
from crosstrain.testing.runs import max_relative_difference, step_losses
from tests.conftest import run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("tensorflow")

import torch.nn.functional as F  # noqa: E402 (after torch is known present)
from torch import nn  # noqa: E402

from crosstrain import import_torch  # noqa: E402
from crosstrain.importers.torch_steps import ImportRefused  # noqa: E402

pytestmark = pytest.mark.cross

QUIET = ("-p", "no:progress")
TRAIN_TOLERANCE = 1e-4
STEPS = 10


class Block(nn.Module):
    """A residual block of one's own: torch.fx opens it into what it calls."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)

    def forward(self, x: Any) -> Any:
        return x + torch.relu(self.bn(self.conv(x)))


class ResidualNet(nn.Module):
    """Conv, batch norm, relu, a residual block, a strided convolution (padding 1: a zero
    pad then a valid convolution), a 1x1 shortcut, max and adaptive average pooling, a mean
    over height and width, flatten (an image's C, H, W features read by a Linear) and a
    concat of channels."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.block = Block(8)
        self.down = nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.shortcut = nn.Conv2d(8, 12, 1, stride=2)
        self.side = nn.Conv2d(12, 4, 1)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 5)
        self.features = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x: Any) -> Any:
        x = F.relu(self.stem_bn(self.stem(x)))
        x = self.block(x)
        x = nn.functional.silu(self.down(x) + self.shortcut(x))
        x = torch.cat([x, self.side(x)], dim=1)
        pooled = self.gap(x).flatten(1) + x.mean((2, 3))
        return self.head(pooled) + self.features(F.relu(torch.flatten(self.pool(x), 1)))


class Encoder(nn.Module):
    """Token and learned position embeddings, self-attention, layer norms, an MLP with GELU,
    residual adds, dropout, then mean pooling and a flattened sequence into Linears."""

    def __init__(self, vocab: int = 20, length: int = 8, units: int = 16) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, units)
        self.positions = nn.Parameter(torch.randn(1, length, units) * 0.1)
        self.attention = nn.MultiheadAttention(units, 4, batch_first=True)
        self.norm1 = nn.LayerNorm(units)
        self.mlp = nn.Sequential(nn.Linear(units, 32), nn.GELU(), nn.Linear(32, units))
        self.norm2 = nn.LayerNorm(units, eps=1e-6)
        self.drop = nn.Dropout(0.1)
        self.pooled = nn.Linear(units, 3)
        self.flat = nn.Linear(length * units, 3)

    def forward(self, ids: Any) -> Any:
        x = self.tokens(ids) + self.positions
        x = self.norm1(x + self.drop(self.attention(x, x, x, need_weights=False)[0]))
        x = self.norm2(x + self.mlp(x))
        return self.pooled(x.mean(dim=1)) + self.flat(torch.flatten(x, 1))


def moved_off_start(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter and running statistic drawn: variances and scales from [0.5, 1.5]."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.dtype != torch.float32:
                continue
            if name.endswith(("running_var", "bn.weight")) or "norm" in name.split(".")[0]:
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            else:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return module.eval()


def _check_forward(module: nn.Module, torch_input: Any, plan_input: np.ndarray, plan_file: Path) -> None:
    with torch.no_grad():
        expected = module(torch_input).numpy()
    for backend in ("torch", "tf"):
        difference = relative_difference(plan_outputs(plan_file, backend, plan_input), expected)
        assert difference <= FORWARD_TOLERANCE, (backend, difference)


def test_a_resnet_style_module_imports_with_its_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = moved_off_start(ResidualNet())
    notes: list[str] = []
    result = import_torch(module, (16, 16, 3), tmp_path / "plan.toml", say=notes.append)
    assert notes == [
        "The Linear 'features' reads an image's features flattened by torch as C, H, W; the plan flattens "
        "H, W, C, so its kernel's rows are permuted to match (same outputs)."
    ]
    statistics = [b for name, b in module.named_buffers() if name.endswith(("running_mean", "running_var"))]
    assert result.parameters == sum(tensor.numel() for tensor in [*module.parameters(), *statistics])
    text = result.plan.read_text()
    assert '{type = "zero_pad2d", name = "down_pad"}' in text  # padding 1, its default
    assert '{type = "batchnorm", name = "block_bn", momentum = 0.99, epsilon = 0.001}' in text
    assert '{type = "mean", name = "mean", axes = [0, 1], inputs = ["cat"]}' in text
    images = np.random.default_rng(1).normal(size=(3, 16, 16, 3)).astype(np.float32)
    _check_forward(module, torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), images, result.plan)


def test_a_transformer_style_module_imports_with_its_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = moved_off_start(Encoder())
    result = import_torch(module, (8,), tmp_path / "plan.toml", say=lambda line: None)
    text = result.plan.read_text()
    assert 'input_dtype = "int32"' in text
    assert '{type = "attention", name = "attention", heads = 4}' in text
    assert '{type = "position_embedding", name = "add"}' in text
    ids = np.random.default_rng(1).integers(0, 20, size=(3, 8)).astype(np.int32)
    _check_forward(module, torch.from_numpy(ids).long(), ids, result.plan)


class Shapes(nn.Module):
    """Transposed convolutions (torch's k=4 s=2 p=1, Keras's 'same'; k=3 s=2 p=1 with
    output_padding 1, a full one cropped), Conv1d and BatchNorm1d on [batch, C, L] (a
    sequence torch holds channels-first), flatten from axis 2, views and reshapes with the
    batch first (image to image, image to sequence, to a vector), and ``x[:, 0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1)
        self.up_cropped = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.down = nn.Conv2d(4, 4, 4, stride=4)
        self.conv1d = nn.Conv1d(4, 6, 3, padding=1)
        self.bn1d = nn.BatchNorm1d(6)
        self.conv1d_strided = nn.Conv1d(6, 6, 3, stride=2, bias=False)
        self.head = nn.Linear(6 * 7 + 7, 5)
        self.image_head = nn.Linear(64, 5)

    def forward(self, x: Any) -> Any:
        x = self.down(torch.relu(self.up_cropped(torch.relu(self.up(x)))))  # [b, 4, 4, 4]
        image = x.reshape(x.size(0), 4, 2, 8)  # an image of other sizes, in torch's order
        sequence = self.bn1d(self.conv1d(x.flatten(2)))  # [b, 6, 16]
        sequence = torch.relu(self.conv1d_strided(sequence))  # [b, 6, 7]
        first = sequence[:, 0]  # [b, 7]
        flat = sequence.view(sequence.size(0), -1)  # [b, 42]
        return self.head(torch.cat([flat, first], dim=1)) + self.image_head(image.view(-1, 64))


def test_shapes_and_one_dimensional_convolutions_import_with_their_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = moved_off_start(Shapes())
    notes: list[str] = []
    result = import_torch(module, (4, 4, 3), tmp_path / "plan.toml", say=notes.append)
    layers = {layer.name: layer for layer in load_plan(result.plan).model.layers}
    assert layers["up"].padding == "same"  # k=4 s=2 p=1: Keras's 'same'
    assert layers["up_cropped"].cropping == ((1, 0), (1, 0))  # the full 9x9 output, from 1, 8 long
    assert [layers[f"conv1d_{side}"].perm for side in ("length_first", "channels_first")] == [(1, 0)] * 2
    assert (layers["getitem"].type, layers["getitem"].index) == ("take", 0)
    # the image read as a vector: flattened H, W, C, the Linear's kernel rows permuted to match
    assert notes == [
        "The Linear 'image_head' reads an image's features flattened by torch as C, H, W; the plan flattens "
        "H, W, C, so its kernel's rows are permuted to match (same outputs)."
    ]
    images = np.random.default_rng(1).normal(size=(3, 4, 4, 3)).astype(np.float32)
    _check_forward(module, torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), images, result.plan)


class Unsupported(nn.Module):
    def __init__(self, call: Callable[[Any], Any]) -> None:
        super().__init__()
        self.call = call

    def forward(self, x: Any) -> Any:
        return self.call(x)


def _causal(x: Any) -> Any:
    return F.scaled_dot_product_attention(x, x, x, is_causal=True)


TORCH_REFUSALS = {
    "a view without the batch first": (
        lambda x: x.view(-1, 4),
        (8, 2),
        "fx node 'view' (Tensor.view): sizes [-1, 4]: the plan reshapes each row; the first size must be "
        "the batch (x.size(0), or -1 followed by the row's sizes)",
    ),
    "a slice": (
        lambda x: x[:, 1:3],
        (8, 2),
        "fx node 'getitem' (operator.getitem): index (slice(None, None, None), slice(1, 3, None)): the plan "
        "takes one position of a sequence, x[:, i] on [batch, length, ...]",
    ),
    "scaled_dot_product_attention": (
        _causal,
        (8, 4),
        "fx node 'scaled_dot_product_attention' (torch._C._nn.scaled_dot_product_attention): attention from "
        "your own projections: the plan's attention is one layer with its projections; use "
        "nn.MultiheadAttention (what imports: docs/import.md)",
    ),
    "a transposed convolution past its full output": (
        nn.ConvTranspose2d(2, 2, 2, stride=2, output_padding=1),
        (3, 3, 2),
        "fx node 'call' (ConvTranspose2d): padding=(0, 0) output_padding=(1, 1): torch's output runs past "
        "the full transposed convolution; the plan's conv2d_transpose and crop2d keep part of it",
    ),
}


@pytest.mark.parametrize("case", sorted(TORCH_REFUSALS))
def test_what_the_plan_cannot_compute_is_refused_in_one_line(case: str) -> None:
    call, shape, message = TORCH_REFUSALS[case]
    with pytest.raises(ImportRefused) as refused:
        import_torch(Unsupported(call), shape, Path("unused.toml"))
    assert str(refused.value) == message


class CausalAttention(nn.Module):
    def __init__(self, mask: Any) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.register_buffer("mask", mask)

    def forward(self, x: Any) -> Any:
        return self.attention(x, x, x, attn_mask=self.mask, is_causal=True, need_weights=False)[0]


def test_causal_multihead_attention_imports_with_its_forward(tmp_path: Path) -> None:
    """``attn_mask`` the causal mask (``is_causal=True``, torch's hint that it is): the plan's
    ``causal = true``; any other mask is refused (here one of zeros)."""
    torch.manual_seed(0)
    later = torch.ones(8, 8, dtype=torch.bool).triu(1)  # True: not attended to (bool: left as it is)
    module = moved_off_start(CausalAttention(later))
    result = import_torch(module, (8, 4), tmp_path / "plan.toml", say=lambda line: None)
    assert load_plan(result.plan).model.layers[0].causal
    rows = np.random.default_rng(1).normal(size=(3, 8, 4)).astype(np.float32)
    _check_forward(module, torch.from_numpy(rows), rows, result.plan)
    with pytest.raises(ImportRefused) as refused:
        import_torch(CausalAttention(torch.zeros(8, 8)), (8, 4), tmp_path / "other.toml")
    assert str(refused.value) == (
        "fx node 'attention' (MultiheadAttention): attn_mask: not the causal mask; the plan's attention "
        "masks later positions only"
    )


class Peaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.peak = nn.AdaptiveMaxPool2d(1)

    def forward(self, x: Any) -> Any:
        return self.peak(self.conv(x))


def reshaped() -> nn.Module:
    return Peaks()


def test_a_call_without_a_plan_equivalent_is_refused_in_one_line(
    cli_in_process: Callable[..., Any], tmp_path: Path
) -> None:
    factory = f"{__name__}:reshaped"
    plan_file = tmp_path / "plan.toml"
    result = cli_in_process(
        "import", factory, "--framework", "torch", "--input-shape", "8,8,1", "--out", str(plan_file)
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "crosstrain: error: fx node 'peak' (AdaptiveMaxPool2d): the plan has no maximum over positions "
        "(what imports: docs/import.md)"
    ]
    assert not list(tmp_path.iterdir())  # nothing written
    missing = cli_in_process("import", factory, "--framework", "torch", "--out", str(plan_file))
    assert missing.returncode == 2
    assert "--input-shape" in missing.stderr


DIGITS_MODULE = """
import torch
from torch import nn


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
"""


def _module_loss(module_file: Path, plan_file: Path, settings: tuple[str, ...]) -> float:
    """The factory's module's own cross-entropy on the plan's eval rows (NCHW), in float64."""
    spec = importlib.util.spec_from_file_location("digits_torch", module_file)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    plan = load_plan(plan_file, [setting for setting in settings if setting != "--set"])
    evaluation = load_datasets(plan).eval
    assert evaluation is not None
    images = torch.from_numpy(evaluation.x.reshape(-1, 8, 8, 1).transpose(0, 3, 1, 2).copy())
    with torch.no_grad():
        logits = loaded.convnet().eval()(images).double()
    return float(F.cross_entropy(logits, torch.from_numpy(evaluation.y).long()))


def test_an_imported_module_trains_from_its_weights_on_both_backends_alike(tmp_path: Path) -> None:
    """``crosstrain import digits_torch:convnet --framework torch``, then ``crosstrain run``
    on torch and on tf: each starts from the module's weights (its step-0 evaluation is the
    module's own loss on the eval rows) and their first steps' losses agree."""
    (tmp_path / "digits_torch.py").write_text(textwrap.dedent(DIGITS_MODULE))
    imported = run_cli(
        "import", "digits_torch:convnet", "--framework", "torch", "--input-shape", "8,8,1",
        "--out", "convnet.toml", cwd=tmp_path,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert "kernel's rows are permuted" in imported.stdout
    settings = ("--set", f"train.max_steps={STEPS}", "--set", "optimizer.lr=0.05")
    runs = {}
    for backend in ("torch", "tf"):
        runs[backend] = tmp_path / backend
        trained = run_cli(
            *QUIET, "run", str(tmp_path / "convnet.toml"), "--backend", backend, "--device", "cpu",
            "--out", str(runs[backend]), *settings,
        )  # fmt: skip
        assert trained.returncode == 0, trained.stderr
    module_loss = _module_loss(tmp_path / "digits_torch.py", tmp_path / "convnet.toml", settings)
    for backend, run in runs.items():
        start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        assert start["step"] == 0 and "eval" in start, start
        assert abs(start["eval"]["loss"] - module_loss) <= 1e-5 * module_loss, (backend, start, module_loss)
    torch_losses, tf_losses = step_losses(runs["torch"]), step_losses(runs["tf"])
    assert len(torch_losses) == STEPS
    assert max_relative_difference(tf_losses, torch_losses) <= TRAIN_TOLERANCE
