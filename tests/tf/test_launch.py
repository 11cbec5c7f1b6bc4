"""The tf launcher without TensorFlow in this process: layouts and TF_CONFIG. (How workers
are watched and stopped is crosstrain.launch's, tested in tests/launch.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.api import prepare_plan
from crosstrain.backends.tf.launch import Cluster, Layout, cluster_from_environment, plan_layout
from crosstrain.core.errors import BackendError
from crosstrain.core.run.job import DeviceChoice, Job
from crosstrain.core.run.job import Layout as JobLayout
from crosstrain.launch.gpus import count_gpus
from tests.conftest import run_cli, worker_env

pytestmark = pytest.mark.tf


@pytest.fixture
def make_job(write_plan: Callable[..., Path]) -> Callable[..., Job]:
    plan = prepare_plan(write_plan())

    def make(replicas: int, workers: int | None = None, device: DeviceChoice = "auto") -> Job:
        return Job(plan=plan, layout=JobLayout("tf", replicas, workers, device=device))

    return make


def test_one_process_holds_every_replica_by_default(make_job: Callable[..., Job]) -> None:
    assert plan_layout(make_job(2), None, gpus=0) == Layout(workers=1, local_replicas=2, device="cpu")
    assert plan_layout(make_job(2), None, gpus=2) == Layout(workers=1, local_replicas=2, device="gpu")
    assert plan_layout(make_job(2, device="cpu"), None, gpus=2).device == "cpu"


def test_workers_split_the_replicas(make_job: Callable[..., Job]) -> None:
    assert plan_layout(make_job(2, 2), None, gpus=0) == Layout(workers=2, local_replicas=1, device="cpu")
    assert plan_layout(make_job(4, 2), None, gpus=4) == Layout(workers=2, local_replicas=2, device="gpu")


@pytest.mark.parametrize(
    ("replicas", "workers", "device", "gpus", "message"),
    [
        (4, 3, "auto", 0, "do not split evenly over 3 workers"),
        (4, 2, "cpu", 0, "one replica per worker"),
        (2, None, "gpu", 0, "--device gpu, but TensorFlow sees no GPU"),
        (4, None, "auto", 2, "--nproc 4 needs 4 GPUs here; TensorFlow sees 2"),
    ],
)
def test_layouts_that_cannot_run_are_refused(
    make_job: Callable[..., Job],
    replicas: int,
    workers: int | None,
    device: DeviceChoice,
    gpus: int,
    message: str,
) -> None:
    with pytest.raises(BackendError, match=message):
        plan_layout(make_job(replicas, workers, device), None, gpus=gpus)


def test_a_given_tf_config_sets_the_workers_and_this_rank(make_job: Callable[..., Job]) -> None:
    config = {"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 1}}
    cluster = cluster_from_environment({"TF_CONFIG": json.dumps(config)})
    assert cluster == Cluster(workers=3, rank=2)
    assert plan_layout(make_job(3), cluster, gpus=0) == Layout(workers=3, local_replicas=1, device="cpu")
    with pytest.raises(BackendError, match="TF_CONFIG describes 3 workers"):
        plan_layout(make_job(3, 2), cluster, gpus=0)
    assert cluster_from_environment({}) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not a valid cluster description"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "joins as chief or worker"),
    ],
)
def test_a_bad_tf_config_is_refused_clearly(text: str, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        cluster_from_environment({"TF_CONFIG": text})


def _printed_by_fresh_python(code: str) -> list[str]:
    """What ``code`` prints, run by a fresh Python (TensorFlow's devices and imports are fixed
    per process), split into words; the run must succeed."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=worker_env()
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_framework_status_leaves_logical_devices_configurable() -> None:
    """`crosstrain backends` and run's checks list devices without starting TensorFlow's
    runtime, which would fix the devices for good."""
    pytest.importorskip("tensorflow")
    code = (
        "import tensorflow as tf\n"
        "from crosstrain.backends.tf.strategy import TfStrategy\n"
        "status = TfStrategy.framework_status()\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "print(status.importable, status.devices[0], len(tf.config.list_logical_devices('CPU')))\n"
    )
    assert _printed_by_fresh_python(code) == ["True", "cpu", "2"]


def test_a_cpu_worker_computes_on_one_thread() -> None:
    """One thread per worker, as torch's: TensorFlow's pools default to every core, and N
    workers on N cores each spawning N threads run several times slower."""
    pytest.importorskip("tensorflow")
    code = (
        "import tensorflow as tf\n"
        "from crosstrain.backends.tf.launch import Layout\n"
        "from crosstrain.backends.tf.worker import configure_devices\n"
        "devices = configure_devices(Layout(workers=1, local_replicas=2, device='cpu'), 0)\n"
        "threading = tf.config.threading\n"
        "print(*devices, threading.get_intra_op_parallelism_threads(), "
        "threading.get_inter_op_parallelism_threads(), len(tf.config.list_logical_devices('CPU')))\n"
    )
    assert _printed_by_fresh_python(code) == ["/cpu:0", "/cpu:1", "1", "1", "2"]


def test_tensorflow_is_imported_without_the_packages_crosstrain_never_calls_through_it() -> None:
    """jax, matplotlib and scikit-learn, which TensorFlow and Keras import when installed, stay
    out of a tf worker's start (seconds of CPU each time), and import as ever afterwards."""
    pytest.importorskip("tensorflow")
    code = (
        "import sys\n"
        "from crosstrain.backends.tf.runtime import NOT_NEEDED_BY_TENSORFLOW, import_tensorflow\n"
        "tf = import_tensorflow()\n"
        "loaded = [name in sys.modules for name in NOT_NEEDED_BY_TENSORFLOW]\n"
        "print(float(tf.reduce_sum(tf.ones(3))), *loaded)\n"
        "import sklearn\n"
        "print(sklearn.__name__)\n"
    )
    assert _printed_by_fresh_python(code) == ["3.0", "False", "False", "False", "sklearn"]


def test_plugin_and_strategy_import_without_tensorflow() -> None:
    code = (
        "import sys\n"
        "import crosstrain.backends.tf.plugin as plugin, crosstrain.backends.tf.launch\n"
        "from crosstrain.backends.tf.strategy import TfStrategy\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
        "sys.modules['tensorflow'] = None  # as if it were not installed\n"
        "status = TfStrategy.framework_status()\n"
        "assert plugin.crosstrain_backends() == [TfStrategy]\n"
        "print(TfStrategy.name, status.importable, status.problem, TfStrategy.install_hint)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "tf False No module named 'tensorflow' pip install 'crosstrain[tf]' (no GPU: 'crosstrain[tf-cpu]')"
    )


@pytest.mark.skipif(count_gpus() > 0, reason="the driver lists a GPU here: TensorFlow is asked")
def test_a_launcher_on_a_machine_without_a_gpu_counts_its_gpus_without_tensorflow() -> None:
    """--device auto asks how many GPUs TensorFlow sees; where the driver lists none, the
    answer is 0 without importing TensorFlow (seconds of CPU in a process that runs no step)."""
    code = (
        "import sys\n"
        "from crosstrain.backends.tf.launch import physical_gpus\n"
        "print(physical_gpus(), 'tensorflow' in sys.modules)\n"
    )
    assert _printed_by_fresh_python(code) == ["0", "False"]


def test_tf_trains_where_torch_cannot_be_imported(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    """tf's suite runs beside torch (the cross env); this run proves the tf backend needs
    none of it: a package named torch that refuses to import comes first on the path."""
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocked.parent), env.get("PYTHONPATH", "")])
    arguments = ("--nproc", "2", "--device", "cpu", "--out", str(tmp_path / "run"))
    arguments += ("--set", "train.max_steps=3")
    result = run_cli("-p", "no:progress", "run", str(write_plan()), "--backend", "tf", *arguments, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_a_refused_layout_writes_nothing(write_plan: Callable[..., Path], tmp_path: Path) -> None:
    result = run_cli(
        "run",
        str(write_plan()),
        "--backend",
        "tf",
        "--nproc",
        "4",
        "--workers",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "o"),
    )
    assert result.returncode == 2
    assert "on CPU, MultiWorkerMirroredStrategy runs one replica per worker" in result.stderr
    assert not (tmp_path / "o").exists()
