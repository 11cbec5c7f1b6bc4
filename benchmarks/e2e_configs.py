"""The end-to-end benchmark's configs (``bench_e2e.py --configs``): each a model, its data
and its native twin, and the plan text crosstrain runs for it. Only what a config builds
imports torch, when it is built: a tf run never loads it.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crosstrain.core.data.scaling import InputScaling

if TYPE_CHECKING:
    import torch
    from torch import nn

# --------------------------------------------------------------------------- configs


def mlp(width: int, batch: int, precision: str, rows: int, features: int | None = None) -> dict[str, Any]:
    """4 hidden layers of ``width``, 10 classes; ``features`` inputs (default: ``width``)."""
    features = features or width
    layers = ", ".join([f'{{ type = "dense", units = {width} }}, {{ type = "relu" }}'] * 4)

    def native() -> nn.Module:
        from torch import nn

        sizes = [features] + [width] * 4
        hidden = [m for a, b in itertools.pairwise(sizes) for m in (nn.Linear(a, b), nn.ReLU())]
        return nn.Sequential(*hidden, nn.Linear(width, 10))

    def native_tf() -> Any:
        import keras

        hidden = [m for _ in range(4) for m in (keras.layers.Dense(width), keras.layers.ReLU())]
        return keras.Sequential([keras.Input((features,)), *hidden, keras.layers.Dense(10)])

    return {
        "input_shape": [features],
        "layers": f'[{layers}, {{ type = "dense", units = 10 }}]',
        "batch": batch,
        "precision": precision,
        "rows": rows,
        "native": native,
        "native_tf": native_tf,
    }


def cnn(
    batch: int,
    precision: str,
    rows: int,
    shape: tuple[int, int, int] = (32, 32, 3),
    filters: tuple[int, int, int] = (64, 128, 256),
) -> dict[str, Any]:
    """Three 3x3 convolutions (pooled after the first two), global average pool, 10 classes."""
    one, two, three = filters
    layers = f"""[
  {{ type = "conv2d", filters = {one}, kernel_size = 3, padding = "same" }}, {{ type = "relu" }},
  {{ type = "maxpool2d", pool_size = 2 }},
  {{ type = "conv2d", filters = {two}, kernel_size = 3, padding = "same" }}, {{ type = "relu" }},
  {{ type = "maxpool2d", pool_size = 2 }},
  {{ type = "conv2d", filters = {three}, kernel_size = 3, padding = "same" }}, {{ type = "relu" }},
  {{ type = "global_avg_pool2d" }}, {{ type = "dense", units = 10 }},
]"""

    def native() -> nn.Module:
        from torch import nn

        class NativeCNN(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = nn.Sequential(
                    nn.Conv2d(shape[2], one, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                    nn.Conv2d(one, two, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                    nn.Conv2d(two, three, 3, padding=1), nn.ReLU(),
                )  # fmt: skip
                self.head = nn.Linear(three, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:  # NHWC in, like crosstrain's data
                features = self.body(x.permute(0, 3, 1, 2).contiguous())
                return self.head(features.mean(dim=(2, 3)))  # type: ignore[no-any-return]

        return NativeCNN()

    def native_tf() -> Any:  # Keras is NHWC already
        import keras
        from keras import layers as k

        return keras.Sequential([
            k.Input(shape), k.Conv2D(one, 3, padding="same"), k.ReLU(), k.MaxPooling2D(2),
            k.Conv2D(two, 3, padding="same"), k.ReLU(), k.MaxPooling2D(2),
            k.Conv2D(three, 3, padding="same"), k.ReLU(), k.GlobalAveragePooling2D(), k.Dense(10),
        ])  # fmt: skip

    return {
        "input_shape": list(shape),
        "layers": layers,
        "batch": batch,
        "precision": precision,
        "rows": rows,
        "native": native,
        "native_tf": native_tf,
    }


def gpt(batch: int, rows: int, width: int = 768, depth: int = 12, length: int = 1024) -> dict[str, Any]:
    """The decoder of examples/stdlib_gpt.toml at GPT-2-small size, on random bytes."""
    layers = f"""[
  {{ type = "embedding", vocab_size = 256, units = {width} }}, {{ type = "position_embedding" }},
  {{ type = "block", block = "decoder", repeat = {depth} }},
  {{ type = "layernorm" }}, {{ type = "dense", units = 256 }},
]
[model.blocks.decoder]
layers = [
  {{ type = "layernorm" }}, {{ type = "attention", heads = {width // 64}, causal = true, name = "att" }},
  {{ type = "add", inputs = ["input", "att"], name = "mid" }},
  {{ type = "layernorm" }}, {{ type = "dense", units = {4 * width} }}, {{ type = "gelu" }},
  {{ type = "dense", units = {width}, name = "mlp" }}, {{ type = "add", inputs = ["mid", "mlp"] }},
]"""

    def native() -> nn.Module:
        import torch
        from torch import nn
        from torch.nn import functional as F

        class Block(nn.Module):
            """Pre-norm decoder block as nanoGPT writes it: fused QKV, SDPA, GELU MLP."""

            def __init__(self) -> None:
                super().__init__()
                self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
                self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
                self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                batch, length, _ = x.shape
                heads = self.qkv(self.norm1(x)).view(batch, length, 3, width // 64, 64)
                q, k, v = heads.permute(2, 0, 3, 1, 4)
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
                return x + self.down(F.gelu(self.up(self.norm2(x))))

        class NativeGPT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(256, width)
                self.position = nn.Parameter(torch.zeros(length, width))
                self.blocks = nn.ModuleList(Block() for _ in range(depth))
                self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256)

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                hidden = self.embed(ids) + self.position
                for block in self.blocks:
                    hidden = block(hidden)
                return self.head(self.norm(hidden))  # type: ignore[no-any-return]

        return NativeGPT()

    return {
        "input_shape": [length],
        "input_dtype": "int32",
        "layers": layers,
        "batch": batch,
        "precision": "bf16",
        "rows": rows,
        "tokens": True,
        "native": native,
        "width": width,
        "depth": depth,
    }


#: AdamW as GPT-2 and nanoGPT train: decay on the matrices only (core's decay = "kernels")
GPT2_OPTIMIZER = 'name = "adamw"\nlr = 0.0006\nweight_decay = 0.1\ndecay = "kernels"'


def gpt2(
    batch: int,
    rows: int,
    vocab: int = 50304,
    width: int = 768,
    depth: int = 12,
    heads: int = 12,
    length: int = 1024,
) -> dict[str, Any]:
    """GPT-2 small (vocabulary 50,304: 50,257 padded to a multiple of 64, as nanoGPT and
    llm.c pad it): learned positions, pre-norm blocks with biases, GELU MLP, the output dense
    tied to the token embedding without a bias of its own; AdamW decaying kernels only.
    The native twin is nanoGPT's model in plain torch: fused QKV, SDPA (causal), the tied
    head, its loss inside the compiled module, fused AdamW over the same two groups."""
    layers = f"""[
  {{ type = "embedding", vocab_size = {vocab}, units = {width}, name = "tokens" }},
  {{ type = "position_embedding" }},
  {{ type = "block", block = "decoder", repeat = {depth} }},
  {{ type = "layernorm" }}, {{ type = "dense", units = {vocab}, use_bias = false, tie = "tokens" }},
]
[model.blocks.decoder]
layers = [
  {{ type = "layernorm" }}, {{ type = "attention", heads = {heads}, causal = true, name = "att" }},
  {{ type = "add", inputs = ["input", "att"], name = "mid" }},
  {{ type = "layernorm" }}, {{ type = "dense", units = {4 * width}, activation = "gelu" }},
  {{ type = "dense", units = {width}, name = "mlp" }}, {{ type = "add", inputs = ["mid", "mlp"] }},
]"""

    def native() -> nn.Module:
        import torch
        from torch import nn
        from torch.nn import functional as F

        head_units = width // heads

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
                self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
                self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                batch, length, _ = x.shape
                qkv = self.qkv(self.norm1(x)).view(batch, length, 3, heads, head_units)
                q, k, v = qkv.permute(2, 0, 3, 1, 4)
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
                return x + self.down(F.gelu(self.up(self.norm2(x))))

        class NativeGPT2(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(vocab, width)
                self.position = nn.Parameter(torch.zeros(length, width))
                self.blocks = nn.ModuleList(Block() for _ in range(depth))
                self.norm = nn.LayerNorm(width)
                self.head = nn.Linear(width, vocab, bias=False)
                self.head.weight = self.embed.weight  # tied: one parameter

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                hidden = self.embed(ids) + self.position
                for block in self.blocks:
                    hidden = block(hidden)
                return self.head(self.norm(hidden))  # type: ignore[no-any-return]

        return NativeGPT2()

    def optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
        """Fused AdamW; decay on the linear layers' matrices only (the tied table, the
        positions, the norms and the biases undecayed), as crosstrain's decay = "kernels"."""
        import torch

        decayed = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.ndim == 2]
        tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        decayed = [p for p in decayed if id(p) not in tied]
        chosen = {id(p) for p in decayed}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        groups = [{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=6e-4, fused=fused or None)

    return {
        "input_shape": [length],
        "input_dtype": "int32",
        "layers": layers,
        "batch": batch,
        "precision": "bf16",
        "rows": rows,
        "tokens": True,
        "vocab": vocab,
        "native": native,
        "native_optimizer": optimizer,
        "optimizer": GPT2_OPTIMIZER,
        "loss_inside": True,
        "width": width,
        "depth": depth,
    }


#: torchvision's ResNet-50 recipe: SGD at 0.1 with momentum 0.9, decay 1e-4 on every weight
RESNET_OPTIMIZER = 'name = "sgd"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.0001'


def _tiny_resnet_settings() -> tuple[str, ...]:
    """What the tiny ResNet-50 sets: the model settings of the zoo's small version
    (docs/zoo.md: the width and the images scaled down, one bottleneck of each kind)."""
    from crosstrain.testing.zoo import ZOO

    return tuple(setting for setting in ZOO["resnet50"].small if setting.startswith("model."))


def resnet50(batch: int, rows: int, tiny: bool = False) -> dict[str, Any]:
    """ResNet-50 at 224x224x3, 1000 classes: crosstrain trains the zoo's plan
    (examples/zoo/resnet50.toml, its model as shipped) on uint8 images it scales; the native
    twin is torchvision's resnet50 in channels-last, its images already scaled on the GPU.
    ``tiny``: the zoo's small version on 32x32 images (a CPU smoke run); its native twin is
    torchvision's ResNet with one bottleneck per stage, or, where torchvision is missing, a
    plain-torch stand-in (said on the output), so the loop itself runs on any CPU."""
    side = 32 if tiny else 224

    def native() -> nn.Module:
        return _from_nhwc(_torchvision_resnet(tiny) if not tiny or available("torchvision") else _stand_in())

    def optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=fused or None
        )

    return {
        "input_shape": [side, side, 3],
        "model_text": _zoo_model_text("resnet50"),
        "settings": _tiny_resnet_settings() if tiny else (),
        "batch": batch,
        "precision": "bf16",
        "rows": rows,
        "images": True,
        "classes": 1000,
        "native": native,
        "native_optimizer": optimizer,
        "optimizer": RESNET_OPTIMIZER,
        "loss_inside": True,
        "channels_last": True,
        "needs": "torchvision" if not tiny else None,
    }


def _zoo_model_text(name: str) -> str:
    """A zoo plan's name, seed and [model] tables (what comes before its [data]), the
    metrics cut to the loss: the bench writes the rest. Read from the installed package
    (crosstrain.testing's copy of examples/zoo), so a wheel install finds it."""
    from crosstrain.testing.zoo import ZOO

    head = ZOO[name].text.split("\n[data]\n")[0]
    return re.sub(r"(?m)^metrics = .*$", 'metrics = ["loss"]', head)


def _torchvision_resnet(tiny: bool) -> nn.Module:
    try:
        from torchvision.models import resnet
    except ImportError as error:  # the full-size config checks this before anything starts
        raise SystemExit(
            f"the native ResNet-50 is torchvision's: pip install torchvision ({error})"
        ) from None
    if tiny:
        return resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=1000)
    return resnet.resnet50()


def _stand_in() -> nn.Module:
    """torchvision is missing (a CPU smoke run only): a stem, one bottleneck, the head."""
    from torch import nn

    print("torchvision is not installed: the tiny native ResNet is a plain-torch stand-in", flush=True)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000),
    )  # fmt: skip


def _from_nhwc(model: nn.Module) -> nn.Module:
    """``model`` fed the NHWC rows crosstrain's data holds, seen as NCHW in channels-last
    memory (a view, no copy), as crosstrain's convolutions see them."""
    from torch import nn

    class NHWCInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x.permute(0, 3, 1, 2))  # type: ignore[no-any-return]

    return NHWCInput()


#: ``train.compile`` against the native twin compiled once, for its ideal loop only (a large
#: model's compile is most of a config's time; the loss read each step costs a 50 ms step
#: nothing measurable)
COMPILED_TWIN: dict[str, Any] = {"compile": True, "native_kinds": ("ideal",)}
CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "mlp1024-fp32": lambda: mlp(1024, 256, "fp32", 65536),
    "mlp1024-bf16": lambda: mlp(1024, 256, "bf16", 65536),
    "mlp4096-bf16": lambda: mlp(4096, 4096, "bf16", 65536),
    # the small CNN of issue 37's outside probe (32x32x3, batch 512, bf16, conv/pool/global
    # average pool): its default step, replayed as one CUDA graph, against cnn-bf16-compile's
    # native twin (docs/performance.md, "When to turn on train.compile")
    "cnn-bf16": lambda: cnn(512, "bf16", 50000),
    "gpt-bf16": lambda: gpt(16, 1024),
    # train.compile against a native loop with torch.compile and fused Adam
    "gpt-bf16-compile": lambda: gpt(16, 1024) | {"compile": True},
    "mlp1024-bf16-compile": lambda: mlp(1024, 256, "bf16", 65536) | {"compile": True},
    "cnn-bf16-compile": lambda: cnn(512, "bf16", 50000) | {"compile": True},
    # data kept on the host (placement = "host"): rows gathered by the prefetch thread and
    # copied on a side stream, against the native loop whose data sits on the GPU
    "mlp4096-bf16-host": lambda: mlp(4096, 4096, "bf16", 65536) | {"placement": "host"},
    # uint8 images scaled as the plan asks (IMAGE_SCALING), kept on the host: the rows travel
    # as uint8 and are scaled on the GPU; the native loop's data sits there scaled already
    "cnn-u8-bf16-host": lambda: cnn(512, "bf16", 50000) | {"images": True, "placement": "host"},
    # sized for one CPU thread (~10-30 s a side over 4 epochs); torch or tf (--backend)
    "cpu-mlp256": lambda: mlp(256, 256, "fp32", 32768, features=64),
    "cpu-cnn": lambda: cnn(128, "fp32", 12288, shape=(16, 16, 3), filters=(16, 32, 64)),
    "cpu-cnn-u8": lambda: cnn(128, "fp32", 12288, shape=(16, 16, 3), filters=(16, 32, 64)) | {"images": True},
    # a step that is almost all host overhead (~0.75 ms native): on a CPU, what bounds the
    # GPU's batch-256 MLPs, the per-step Python of the loop, the feed and the step
    "cpu-mlp16": lambda: mlp(16, 256, "fp32", 65536, features=16),
    # issue 26's figures of record (docs/performance.md), each compiled side against the
    # native twin compiled (torch.compile, mode "reduce-overhead", fused optimizer); the
    # tokens and rows keep every side of a config under ~4 minutes on one H100, compiling included
    "gpt2-small-compile": lambda: gpt2(16, 1536) | COMPILED_TWIN,
    "gpt2-small-b32-compile": lambda: gpt2(32, 1536) | COMPILED_TWIN,
    # train.shard = "full" at world 1 (issue 37: sharding costs nothing where it cannot
    # help); crosstrain's side only, read against gpt2-small-compile's of the same invocation
    "gpt2-small-full-compile": lambda: (
        gpt2(16, 1536) | COMPILED_TWIN | {"settings": ("train.shard='full'",), "native_kinds": ()}
    ),
    "resnet50-bf16": lambda: resnet50(256, 8192),
    "resnet50-bf16-compile": lambda: resnet50(256, 8192) | COMPILED_TWIN,
}
#: ``--tiny``: the same sides at a size a CPU runs in seconds (a smoke run of every path,
#: not a figure): GPT-2's shape at 2 blocks of 64, vocabulary 512, sequence 64; the zoo's
#: small ResNet-50 on 32x32 images
TINY_CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpt2-small-compile": lambda: (
        gpt2(4, 64, vocab=512, width=64, depth=2, heads=4, length=64) | COMPILED_TWIN
    ),
    "gpt2-small-b32-compile": lambda: (
        gpt2(8, 64, vocab=512, width=64, depth=2, heads=4, length=64) | COMPILED_TWIN
    ),
    "resnet50-bf16": lambda: resnet50(8, 64, tiny=True),
    "resnet50-bf16-compile": lambda: resnet50(8, 64, tiny=True) | COMPILED_TWIN,
}
#: what an ``images`` config's plan asks of its uint8 pixels (ImageNet's per-channel statistics)
IMAGE_SCALING = InputScaling(1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
#: bf16 matrix rate of one H200 as measured on the lent machine (NVIDIA's dense peak is
#: 989e12): the issue's MFU figures (42 % eager, 51 % compiled) count against this one
PEAK_FLOPS = 790e12


def plan_text(name: str, config: dict[str, Any], epochs: int, directory: Path) -> str:
    if config.get("tokens"):
        length = config["input_shape"][0]
        data = f'source = "tokens"\npath = "{directory / "tokens.npy"}"\nsequence_length = {length}'
    else:
        data = f'source = "npy"\nx_path = "{directory / "x.npy"}"\ny_path = "{directory / "y.npy"}"'
    data += f'\nplacement = "{config.get("placement", "auto")}"'
    if config.get("images"):
        data += f"\nscale = {IMAGE_SCALING.scale!r}\nmean = {list(IMAGE_SCALING.mean)}"
        data += f"\nstd = {list(IMAGE_SCALING.std)}"
    # a zoo plan's own model, or the config's layers
    model = (
        config.get("model_text")
        or f"""
name = "{name}"
metrics = ["loss"]
[model]
input_shape = {config["input_shape"]}
input_dtype = "{config.get("input_dtype", "float32")}"
layers = {config["layers"]}"""
    )
    optimizer = config.get("optimizer", 'name = "adam"\nlr = 0.0001')
    return f"""{model}
[data]
{data}
eval_fraction = 0.0
[optimizer]
{optimizer}
[train]
global_batch_size = {config["batch"]}
epochs = {epochs}
precision = "{config["precision"]}"
compile = {"true" if config.get("compile") else "false"}
cuda_graph = {"false" if config.get("launched") else "true"}
[output]
checkpoint = false
"""


def available(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None
