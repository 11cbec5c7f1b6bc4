"""What every cluster environment tells: the processes an outside launcher started and
this process's place among them."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from crosstrain.core.errors import InputError


class ClusterEnvironment(ABC):
    """One way processes get started (torchrun, SLURM's srun, Kubeflow, a TF_CONFIG, or
    crosstrain itself). ``detect`` says whether this process runs under it; the other
    methods read its facts from the same variables."""

    #: how messages name the environment ("SLURM", "torchrun", ...)
    name: ClassVar[str]
    #: the variable that counts its processes, named in mismatch errors
    size_variable: ClassVar[str]
    #: True: crosstrain starts the worker processes itself; False: every process was
    #: started outside and runs ``crosstrain run`` (it is one worker)
    starts_processes: ClassVar[bool] = False

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    @classmethod
    @abstractmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        """Whether ``environ`` is this environment's."""

    @abstractmethod
    def world_size(self) -> int:
        """Processes in all."""

    @abstractmethod
    def rank(self) -> int:
        """This process's rank among them."""

    def local_rank(self) -> int:
        """This process's index on its machine (its GPU)."""
        return 0

    def node_rank(self) -> int:
        return self.rank()

    @abstractmethod
    def main_address(self) -> str:
        """The host of rank 0, where the others meet."""

    @abstractmethod
    def main_port(self) -> int:
        """A port on that host for the meeting (torch's MASTER_PORT)."""

    def exchange_port(self) -> int:
        """Where rank 0 serves the address exchange of a framework that needs every
        worker's address up front (tf's TF_CONFIG): the main port, unless it is taken."""
        return self.main_port()

    def describe(self) -> str:
        """The environment as errors name it, e.g. ``the SLURM environment (SLURM_NTASKS=2)``."""
        return f"the {self.name} environment ({self.size_variable}={self.world_size()})"

    # ----------------------------------------------------------------- helpers

    def _int(self, name: str) -> int:
        value = self.environ.get(name, "")
        try:
            return int(value)
        except ValueError:
            raise InputError(f"{self.name} environment: {name}={value!r} is not a whole number") from None


def has_all(environ: Mapping[str, str], names: tuple[str, ...]) -> bool:
    return all(environ.get(name) for name in names)
