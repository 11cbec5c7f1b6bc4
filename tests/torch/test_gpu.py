"""NCCL on real GPUs. CI has none, so these skip there; run them by hand on a GPU machine:

pytest tests/torch/test_gpu.py -m gpu
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, run_cli
from tests.support import summary

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.torch,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_digits_on_gpu(tmp_path: Path, precision: str) -> None:
    gpus = torch.cuda.device_count()
    result = run_cli(
        "run",
        str(EXAMPLES / "digits_mlp.toml"),
        "--device",
        "gpu",
        "--nproc",
        str(gpus),
        "--out",
        str(tmp_path),
        "--set",
        f"train.precision='{precision}'",
    )
    assert result.returncode == 0, result.stderr
    result_summary = summary(tmp_path)
    assert result_summary["device"].startswith("cuda")
    assert result_summary["eval"]["accuracy"] >= 0.95


def test_gpu_request_without_enough_gpus_is_refused(tmp_path: Path) -> None:
    too_many = torch.cuda.device_count() + 1
    result = run_cli(
        "run",
        str(EXAMPLES / "digits_mlp.toml"),
        "--device",
        "gpu",
        "--nproc",
        str(too_many),
        "--out",
        str(tmp_path),
        "--set",
        "train.global_batch_size=" + str(64 * too_many),
    )
    assert result.returncode == 2
    assert f"needs {too_many} GPUs" in result.stderr
