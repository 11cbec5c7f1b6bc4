"""What runs inside each torch worker process: join the process group, build the
strategy, run :func:`crosstrain.core.run.worker.run_worker`, leave the group.

The launching side (:mod:`crosstrain.backends.torch.launch`) hands :func:`worker_main` to
torch's elastic agent together with the strategy's class, which the agent pickles (by
reference) to every worker; so this module imports neither the launcher nor the strategy,
and the strategy imports the launcher, which imports this: one direction, no circle.
The tf backend's worker.py is its mirror.
"""

from __future__ import annotations

import datetime
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from crosstrain.backends.host import CPU_THREADS
from crosstrain.core.errors import BackendError
from crosstrain.core.run.heartbeat import HEARTBEAT_DIR, collective_timeout
from crosstrain.core.run.job import Job, World
from crosstrain.core.run.strategy import DistributedStrategy
from crosstrain.core.run.worker import attempt_job, run_worker
from crosstrain.launch import die_with_parent
from crosstrain.launch.environments import LocalEnvironment, TorchElasticEnvironment, detect_environment
from crosstrain.launch.monitor import a_peer_has_exited

#: the launcher's process id, read by its workers to die with it (unset under torchrun)
LAUNCHER_PID = "CROSSTRAIN_LAUNCHER_PID"
#: what builds a worker's strategy from its world and device: TorchStrategy itself
StrategyMaker = Callable[[World, str], DistributedStrategy]
#: how long a failed rank watches for a peer's exit (a killed peer's sockets close before
#: its process is gone), and then waits for the agent to see that exit: the agent names the
#: first exited worker its poll (every 0.1 s) finds, which must be the peer
_ECHO_WINDOW_SECONDS, _ECHO_DELAY_SECONDS = 0.3, 0.5


def resolve_device(choice: str) -> str:
    """'auto' is the GPU when there is one; 'gpu' without one is an error, not a silent CPU run.
    'cpu' asks CUDA nothing (a worker forked after its launcher asked could not)."""
    if choice == "cpu":
        return "cpu"
    has_gpu = torch.cuda.is_available()
    if choice == "gpu" and not has_gpu:
        raise BackendError("--device gpu, but torch sees no CUDA GPU")
    return "cuda" if choice == "gpu" or (choice == "auto" and has_gpu) else "cpu"


@record
def worker_main(job: Job, make_strategy: StrategyMaker) -> dict[str, Any]:
    """Entry point of each worker process (the elastic agent calls it, or the CLI under
    torchrun): join the group, build the strategy, train, leave the group."""
    _die_with_launcher()
    world, device = join_group(job)
    job = attempt_job(job, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    try:
        return run_worker(make_strategy(world, device), job)
    except BaseException:
        _leave_the_group()  # peers waiting on this rank fail now, and end cleanly, while it waits
        _let_the_cause_exit_first()
        raise
    finally:
        _leave_the_group()


def _leave_the_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _let_the_cause_exit_first() -> None:
    """A failure right after a peer exited is most likely that peer's echo (a collective it
    broke): waiting a moment lets the agent see the peer's exit, with its signal or report,
    first. A failure with no peer gone yet (the cause) waits the window out, so that the
    peers it broke finish their own ending (freeing what they hold) before the agent, which
    stops the survivors of the first exit it sees, stops them. The launcher's heartbeat
    folder tells which peers exited."""
    folder = os.environ.get(HEARTBEAT_DIR)
    if folder is None:
        return
    watch_until = time.monotonic() + _ECHO_WINDOW_SECONDS
    while not a_peer_has_exited(Path(folder)):
        if time.monotonic() > watch_until:
            return
        time.sleep(0.02)
    time.sleep(_ECHO_DELAY_SECONDS)


def _die_with_launcher() -> None:
    """SIGKILL when the launcher dies (torch's own parent-death signal is SIGINT, which a
    worker blocked in a collective does not act on), and a quiet exit on SIGINT: the
    launcher, which gets a terminal's Ctrl-C too, reports the interruption once.
    A worker forked from the launcher (on a CPU) drops what it inherited from it: the agent's
    signal handlers, which would make the agent's SIGTERM an exception that a worker blocked
    in a collective never raises, and the launch folder as its temporary folder."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None:  # joined a torchrun group: this process is the CLI, torchrun the agent
        return
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    tempfile.tempdir = None
    die_with_parent(int(launcher))
    signal.signal(signal.SIGINT, lambda number, frame: os._exit(128 + number))


def join_group(job: Job) -> tuple[World, str]:
    """Under the agent, torchrun or an outside launcher, the environment says where this
    process stands (:mod:`crosstrain.launch.environments`)."""
    environment = detect_environment()
    rank, world_size, local_rank = environment.rank(), environment.world_size(), environment.local_rank()
    if not isinstance(environment, (TorchElasticEnvironment, LocalEnvironment)):
        # srun, Kubeflow or a TF_CONFIG: torch's env:// reads torchrun's names
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            MASTER_ADDR=environment.main_address(),
            MASTER_PORT=str(environment.main_port()),
        )
    device = resolve_device(job.device)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        torch.set_num_threads(CPU_THREADS)  # one replica per process
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.startswith("cuda") else "gloo",
            # longer than the heartbeat deadline: a hang is reported naming the rank behind
            timeout=datetime.timedelta(seconds=collective_timeout(job.launch.timeout_seconds)),
            device_id=torch.device(device) if device.startswith("cuda") else None,
        )
    return World(process_index=rank, process_count=world_size, local_replicas=1, device=device), device
