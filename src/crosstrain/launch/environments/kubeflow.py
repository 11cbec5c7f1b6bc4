"""Kubeflow's PyTorchJob: one process per pod, each told the master pod and its rank,
without torchrun's LOCAL_RANK and TORCHELASTIC_* variables. (A TFJob sets TF_CONFIG
instead: :mod:`crosstrain.launch.environments.tf_config`.)"""

from __future__ import annotations

from collections.abc import Mapping

from crosstrain.launch.environments.base import ClusterEnvironment, has_all

KUBEFLOW_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class KubeflowEnvironment(ClusterEnvironment):
    name = "Kubeflow PyTorchJob"
    size_variable = "WORLD_SIZE"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        torchrun = "LOCAL_RANK" in environ or any(name.startswith("TORCHELASTIC_") for name in environ)
        return has_all(environ, KUBEFLOW_VARIABLES) and not torchrun

    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    def rank(self) -> int:
        return self._int("RANK")

    def main_address(self) -> str:
        return self.environ["MASTER_ADDR"]

    def main_port(self) -> int:
        return self._int("MASTER_PORT")
