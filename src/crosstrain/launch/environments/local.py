"""No outside launcher: crosstrain starts the processes (on one machine, or on each of
the ``--nnodes`` machines)."""

from __future__ import annotations

from collections.abc import Mapping

from crosstrain.launch.environments.base import ClusterEnvironment


class LocalEnvironment(ClusterEnvironment):
    name = "local"
    size_variable = "--nproc"
    starts_processes = True

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return True  # the default, tried last

    def world_size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def main_address(self) -> str:
        return "127.0.0.1"

    def main_port(self) -> int:
        return 0  # crosstrain picks a free one when it launches
