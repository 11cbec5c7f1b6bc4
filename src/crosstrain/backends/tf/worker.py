"""What runs inside each tf worker process: make its devices visible, build the
tf.distribute strategy and crosstrain's, run :func:`crosstrain.core.run.worker.run_worker`.

The launching side (:mod:`crosstrain.backends.tf.launch`) starts a fresh python running
:func:`worker_main` (named in its command line, not imported) and leaves the job, the
layout and the strategy's class (pickled by reference) in the launch folder; so this
module imports the launcher's names but never the strategy's module, and the strategy
imports the launcher: one direction, no circle. The torch backend's worker.py is its
mirror.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Sequence
from typing import Any

from crosstrain.backends.host import CPU_THREADS
from crosstrain.backends.tf.launch import JOB_FILE, Layout, StrategyMaker
from crosstrain.backends.tf.runtime import import_tensorflow
from crosstrain.core.errors import BackendError
from crosstrain.core.run.heartbeat import collective_timeout
from crosstrain.core.run.job import Job, World
from crosstrain.core.run.worker import attempt_job, run_worker
from crosstrain.launch import serve
from crosstrain.launch.worker import restart_count, worker_folder, worker_rank


def worker_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of each worker process: ``LOCAL_INDEX``; the launch folder and rank come
    from the environment (:mod:`crosstrain.launch.worker`)."""
    (local_text,) = list(sys.argv[1:] if argv is None else argv)

    def train() -> dict[str, Any]:
        with open(worker_folder() / JOB_FILE, "rb") as handle:
            job, layout, make_strategy = pickle.load(handle)
        job = attempt_job(job, restart_count())  # a restarted group resumes
        return _train(job, layout, make_strategy, worker_rank(), int(local_text))

    serve(train)


def _train(
    job: Job, layout: Layout, make_strategy: StrategyMaker, rank: int, local_index: int
) -> dict[str, Any]:
    devices = configure_devices(layout, local_index)
    distribution = make_distribution(job, layout, devices)
    world = World(
        process_index=rank,
        process_count=layout.workers,
        local_replicas=layout.local_replicas,
        device=layout.device,
    )
    if distribution.num_replicas_in_sync != world.replicas:
        raise BackendError(
            f"TensorFlow made {distribution.num_replicas_in_sync} replicas, the job asks for {world.replicas}"
        )
    return run_worker(make_strategy(world, distribution), job)


def configure_devices(layout: Layout, local_index: int) -> list[str]:
    """Make this process's replica devices visible; must run before any TensorFlow op."""
    tf = import_tensorflow()

    count = layout.local_replicas
    if layout.device == "gpu":
        mine = tf.config.list_physical_devices("GPU")[local_index * count : (local_index + 1) * count]
        tf.config.set_visible_devices(mine, "GPU")
        for gpu in mine:
            tf.config.experimental.set_memory_growth(gpu, True)
        # fp32 in IEEE float32, as torch's backend computes it: TensorFlow's matrix products
        # and convolutions default to TF32 (a 10-bit mantissa) on Ampere and later GPUs
        tf.config.experimental.enable_tensor_float_32_execution(False)
        return [f"/gpu:{index}" for index in range(count)]
    tf.config.set_visible_devices([], "GPU")
    if count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    # as torch's workers: one thread (TensorFlow's defaults size both pools to every core).
    # Two replicas in one process gain nothing from an inter-op thread each
    # (docs/performance.md#measurements-behind-the-code)
    tf.config.threading.set_intra_op_parallelism_threads(CPU_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(CPU_THREADS)
    return [f"/cpu:{index}" for index in range(count)]


def make_distribution(job: Job, layout: Layout, devices: list[str]) -> Any:
    import tensorflow as tf

    if layout.workers == 1:
        return tf.distribute.MirroredStrategy(devices=devices)
    # longer than the launcher's heartbeat deadline: a hang is reported naming the rank behind
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=collective_timeout(job.launch.timeout_seconds)
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
