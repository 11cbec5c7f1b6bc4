"""What core knows of the cluster a process runs under: the few facts the admission step
holds the layout flags against, and the ``--rdzv-endpoint`` syntax.

The environments themselves (torchrun, SLURM, Kubeflow, TF_CONFIG, detected from the
process's variables) are launch's (:mod:`crosstrain.launch.environments`), one floor up;
each of them is a :class:`Cluster`, so core reads their facts without importing launch.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from crosstrain.core.errors import InputError


class Cluster(Protocol):
    """The facts of :class:`crosstrain.launch.environments.ClusterEnvironment` that
    admission reads."""

    @property
    def starts_processes(self) -> bool:
        """True: crosstrain starts the workers; False: an outside launcher started every
        process, and each runs ``crosstrain run`` (it is one worker)."""
        ...

    def world_size(self) -> int:
        """Processes in all."""
        ...

    def rank(self) -> int:
        """This process's rank among them."""
        ...

    def describe(self) -> str:
        """How messages name the environment and its size (e.g. "the SLURM environment
        (SLURM_NTASKS=8)")."""
        ...


@attrs.frozen
class ThisMachine:
    """No outside launcher: crosstrain starts the processes here (what
    :class:`~crosstrain.launch.environments.LocalEnvironment` says)."""

    starts_processes: bool = True

    def world_size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def describe(self) -> str:
        return "this machine"


def default_replicas(cluster: Cluster, nproc: int | None, nnodes: int) -> int:
    """``--nproc``, or when it is left out: what an outside launcher started, else one
    replica per machine. Only resolved here; admission holds the result against the flags."""
    if nproc is not None:
        return nproc
    return nnodes if cluster.starts_processes else cluster.world_size()


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), refused with the flag's name."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (node 0's address)")
    return host.strip("[]"), int(port)


def mismatch(cluster: Cluster, nproc: int) -> str:
    """The error of ``--nproc`` against an outside launcher's processes; names both."""
    return (
        f"--nproc {nproc}, but {cluster.describe()} "
        f"(leave --nproc out to take the environment's, or unset its variables if they are "
        f"left over from another run)"
    )
