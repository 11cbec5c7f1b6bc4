"""torchrun (TorchElastic): it started every process with the five variables below."""

from __future__ import annotations

from collections.abc import Mapping

from crosstrain.launch.environments.base import ClusterEnvironment, has_all

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TorchElasticEnvironment(ClusterEnvironment):
    name = "torchrun"
    size_variable = "WORLD_SIZE"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return has_all(environ, TORCHRUN_VARIABLES)

    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    def rank(self) -> int:
        return self._int("RANK")

    def local_rank(self) -> int:
        return self._int("LOCAL_RANK")

    def node_rank(self) -> int:
        return self._int("GROUP_RANK") if self.environ.get("GROUP_RANK") else 0

    def main_address(self) -> str:
        return self.environ["MASTER_ADDR"]

    def main_port(self) -> int:
        return self._int("MASTER_PORT")

    def exchange_port(self) -> int:
        # torchrun's agent serves its store on MASTER_PORT (shared with the workers)
        return self.main_port() + 1

    def describe(self) -> str:
        return f"the torchrun environment says WORLD_SIZE={self.world_size()}"
