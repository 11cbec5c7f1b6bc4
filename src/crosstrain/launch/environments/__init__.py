"""Cluster environments, Lightning-style: one small class per way processes get started,
each with ``detect()`` and the facts (world size, ranks, rank 0's address and port).

The same environment serves every backend: under torchrun or SLURM, torch joins the
group through it and tf builds its TF_CONFIG from it. The admission step
(:func:`crosstrain.core.admission.checks.admit`) holds the flags (``--nproc``, ``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``) against it, so a mismatch is an error naming both
before anything starts, never a silent override.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from crosstrain.core.admission.cluster import default_replicas, mismatch, parse_endpoint
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
    "default_replicas",
    "detect_environment",
    "first_host",
    "mismatch",
    "parse_endpoint",
]
