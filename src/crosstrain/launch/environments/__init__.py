"""Cluster environments, Lightning-style: one small class per way processes get started,
each with ``detect()`` and the facts (world size, ranks, rank 0's address and port).

The same environment serves every backend: under torchrun or SLURM, torch joins the
group through it and tf builds its TF_CONFIG from it. :func:`check_cluster` holds the
flags (``--nproc``, ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``) against it, so a
mismatch is an error naming both before anything starts, never a silent override.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from crosstrain.core.errors import InputError
from crosstrain.launch.environments.base import ClusterEnvironment
from crosstrain.launch.environments.kubeflow import KubeflowEnvironment
from crosstrain.launch.environments.local import LocalEnvironment
from crosstrain.launch.environments.slurm import SlurmEnvironment, first_host
from crosstrain.launch.environments.tf_config import TF_CONFIG, TfConfigEnvironment
from crosstrain.launch.environments.torchrun import TORCHRUN_VARIABLES, TorchElasticEnvironment

#: tried in this order; torchrun first (it may run inside a SLURM job), local last
ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    KubeflowEnvironment,
    TfConfigEnvironment,
    SlurmEnvironment,
    LocalEnvironment,
)


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The environment this process runs under; :class:`LocalEnvironment` when none."""
    environ = os.environ if environ is None else environ
    kind = next(kind for kind in ENVIRONMENTS if kind.detect(environ))
    return kind(environ)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), refused with the flag's name."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (node 0's address)")
    return host.strip("[]"), int(port)


def check_cluster(
    environment: ClusterEnvironment,
    nproc: int | None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str = "",
) -> int:
    """The replicas in all (``--nproc``, or what the environment started), after holding
    the flags against each other and against the environment."""
    if not environment.starts_processes:
        return _check_outside(environment, nproc, nnodes)
    if nnodes < 1:
        raise InputError(f"--nnodes {nnodes}: the number of machines must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank {node_rank}: must be from 0 to --nnodes - 1 ({nnodes - 1})")
    if nnodes > 1 and not rdzv_endpoint:
        raise InputError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if rdzv_endpoint:
        parse_endpoint(rdzv_endpoint)
    replicas = nnodes if nproc is None else nproc
    if replicas % nnodes:
        raise InputError(
            f"--nproc {replicas} is not a multiple of --nnodes {nnodes} "
            f"(--nproc counts the replicas on all machines)"
        )
    return replicas


def _check_outside(environment: ClusterEnvironment, nproc: int | None, nnodes: int) -> int:
    """Under an outside launcher every process runs the CLI; it, not the flags, sets the world."""
    processes = environment.world_size()
    if nnodes != 1:
        raise InputError(
            f"--nnodes {nnodes}, but {environment.describe()}: it starts the processes on every "
            f"machine, so leave --nnodes, --node-rank and --rdzv-endpoint out"
        )
    if nproc is None:
        return processes
    if nproc % processes:
        raise InputError(mismatch(environment, nproc))
    return nproc


def mismatch(environment: ClusterEnvironment, nproc: int) -> str:
    """The error of ``--nproc`` against an outside launcher's processes; names both."""
    return (
        f"--nproc {nproc}, but {environment.describe()} "
        f"(leave --nproc out to take the environment's, or unset its variables if they are "
        f"left over from another run)"
    )


__all__ = [
    "ENVIRONMENTS",
    "TF_CONFIG",
    "TORCHRUN_VARIABLES",
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LocalEnvironment",
    "SlurmEnvironment",
    "TfConfigEnvironment",
    "TorchElasticEnvironment",
    "check_cluster",
    "detect_environment",
    "first_host",
    "mismatch",
    "parse_endpoint",
]
