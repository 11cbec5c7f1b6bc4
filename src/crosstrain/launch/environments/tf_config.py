"""A TF_CONFIG the processes were started with (Kubeflow's TFJob, or by hand): the
cluster, and this process's task in it. The chief, if any, is rank 0, then the workers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from crosstrain.core.errors import BackendError
from crosstrain.launch.environments.base import ClusterEnvironment

TF_CONFIG = "TF_CONFIG"


class TfConfigEnvironment(ClusterEnvironment):
    name = "TF_CONFIG"
    size_variable = "TF_CONFIG"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return bool(environ.get(TF_CONFIG))

    def _config(self) -> tuple[list[str], int]:
        """Every task's address, rank 0 first, and this task's rank."""
        try:
            config: dict[str, Any] = json.loads(self.environ[TF_CONFIG])
            spec, task = config["cluster"], config["task"]
            task_type, task_index = str(task["type"]), int(task["index"])
            chiefs, workers = list(spec.get("chief", [])), list(spec.get("worker", []))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BackendError(f"TF_CONFIG is not a valid cluster description: {error}") from None
        if task_type not in ("chief", "worker"):
            raise BackendError(f"TF_CONFIG task type {task_type!r}: crosstrain joins as chief or worker")
        rank = task_index if task_type == "chief" else len(chiefs) + task_index
        return [*chiefs, *workers], rank

    def world_size(self) -> int:
        return len(self._config()[0])

    def rank(self) -> int:
        return self._config()[1]

    def _main(self) -> tuple[str, int]:
        host, _, port = self._config()[0][0].rpartition(":")
        return host, int(port)

    def main_address(self) -> str:
        return self._main()[0]

    def main_port(self) -> int:
        return self._main()[1]

    def describe(self) -> str:
        return f"TF_CONFIG describes {self.world_size()} workers"
