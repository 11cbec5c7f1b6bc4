"""SLURM's srun: one task per replica (``srun --ntasks-per-node=G crosstrain run ...``).
The first host of the job's node list is rank 0's; the port comes from the job id, so
every task derives the same one without talking."""

from __future__ import annotations

import re
from collections.abc import Mapping

from crosstrain.core.errors import InputError
from crosstrain.launch.environments.base import ClusterEnvironment, has_all

SLURM_VARIABLES = ("SLURM_NTASKS", "SLURM_PROCID")
#: an interactive allocation's shell (salloc, srun --pty bash) is not a task of the job
_INTERACTIVE = ("bash", "interactive")
_PORT_BASE = 15000
_FIRST_HOST = re.compile(r"^([^,\[]+)(?:\[([^\]]+)\])?")


def first_host(nodelist: str) -> str:
    """``node[01-04,07],gpu1`` -> ``node01``: the first host of a SLURM node list."""
    match = _FIRST_HOST.match(nodelist.strip())
    if match is None:
        raise InputError(f"SLURM environment: SLURM_NODELIST={nodelist!r} names no host")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


class SlurmEnvironment(ClusterEnvironment):
    name = "SLURM"
    size_variable = "SLURM_NTASKS"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return has_all(environ, SLURM_VARIABLES) and environ.get("SLURM_JOB_NAME") not in _INTERACTIVE

    def world_size(self) -> int:
        return self._int("SLURM_NTASKS")

    def rank(self) -> int:
        return self._int("SLURM_PROCID")

    def local_rank(self) -> int:
        return self._int("SLURM_LOCALID") if self.environ.get("SLURM_LOCALID") else 0

    def node_rank(self) -> int:
        return self._int("SLURM_NODEID") if self.environ.get("SLURM_NODEID") else 0

    def main_address(self) -> str:
        nodelist = self.environ.get("SLURM_NODELIST") or self.environ.get("SLURM_JOB_NODELIST", "")
        return first_host(nodelist) if nodelist else "127.0.0.1"

    def main_port(self) -> int:
        """15000 + the job id's last four digits, as Lightning does: the same in every task."""
        if self.environ.get("MASTER_PORT"):  # a user's choice wins
            return self._int("MASTER_PORT")
        job_id = self.environ.get("SLURM_JOB_ID", "")
        if not job_id.isdigit():
            raise InputError(f"SLURM environment: SLURM_JOB_ID={job_id!r} is not a job number")
        return _PORT_BASE + int(job_id[-4:])
