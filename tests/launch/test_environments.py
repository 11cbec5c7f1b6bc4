"""Cluster environments from simulated variables: which one is detected, what it says, and
the flags held against it. No framework, no process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from crosstrain.core.admission.checks import check_cluster, owns_run_folder
from crosstrain.core.errors import BackendError, InputError
from crosstrain.launch.environments import (
    KubeflowEnvironment,
    LocalEnvironment,
    SlurmEnvironment,
    TfConfigEnvironment,
    TorchElasticEnvironment,
    default_replicas,
    detect_environment,
    first_host,
    parse_endpoint,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
}
SLURM = {
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NODELIST": "gpu[007-010,12],cpu1",
    "SLURM_JOB_ID": "4821337",
    "SLURM_JOB_NAME": "train",
}
KUBEFLOW = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
TFJOB = {
    "TF_CONFIG": json.dumps(
        {
            "cluster": {"chief": ["chief-0:2222"], "worker": ["worker-0:2222", "worker-1:2222"]},
            "task": {"type": "worker", "index": 1},
        }
    )
}


def _facts(environ: dict[str, str]) -> tuple[str, int, int, int, int, str, int]:
    found = detect_environment(environ)
    return (
        type(found).__name__,
        found.world_size(),
        found.rank(),
        found.local_rank(),
        found.node_rank(),
        found.main_address(),
        found.main_port(),
    )


@pytest.mark.parametrize(
    ("environ", "facts"),
    [
        ({}, ("LocalEnvironment", 1, 0, 0, 0, "127.0.0.1", 0)),
        (TORCHRUN, ("TorchElasticEnvironment", 4, 3, 1, 1, "node0", 29500)),
        (SLURM, ("SlurmEnvironment", 8, 5, 1, 2, "gpu007", 15000 + 1337)),
        (KUBEFLOW, ("KubeflowEnvironment", 3, 2, 0, 2, "job-master-0", 23456)),
        (TFJOB, ("TfConfigEnvironment", 3, 2, 0, 2, "chief-0", 2222)),
        # torchrun started inside a SLURM job: torchrun's processes are the workers
        ({**SLURM, **TORCHRUN}, ("TorchElasticEnvironment", 4, 3, 1, 1, "node0", 29500)),
        # a user's MASTER_PORT wins over the one derived from the job id
        ({**SLURM, "MASTER_PORT": "1234"}, ("SlurmEnvironment", 8, 5, 1, 2, "gpu007", 1234)),
    ],
)
def test_each_environment_is_detected_with_its_facts(
    environ: dict[str, str], facts: tuple[str, int, int, int, int, str, int]
) -> None:
    assert _facts(environ) == facts


def test_kubeflow_is_not_taken_for_torchrun_or_the_reverse() -> None:
    assert not KubeflowEnvironment.detect({**KUBEFLOW, "LOCAL_RANK": "0"})
    assert not KubeflowEnvironment.detect({**KUBEFLOW, "TORCHELASTIC_RUN_ID": "x"})
    assert not TorchElasticEnvironment.detect(KUBEFLOW)
    assert KubeflowEnvironment.detect(KUBEFLOW)


def test_an_interactive_slurm_shell_is_not_a_task() -> None:
    assert not SlurmEnvironment.detect({**SLURM, "SLURM_JOB_NAME": "bash"})
    assert isinstance(detect_environment({**SLURM, "SLURM_JOB_NAME": "interactive"}), LocalEnvironment)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node[01-04]", "node01"),
        ("node[3,5-7]", "node3"),
        ("a100-12", "a100-12"),
        ("gpu1,gpu2", "gpu1"),
        ("rack2-node[0008-0016],rack3-node1", "rack2-node0008"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_the_torchrun_exchange_port_leaves_the_agents_store_alone() -> None:
    assert TorchElasticEnvironment(TORCHRUN).exchange_port() == 29501
    assert SlurmEnvironment(SLURM).exchange_port() == 16337


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({**SLURM, "SLURM_PROCID": "x"}, "SLURM environment: SLURM_PROCID='x' is not a whole number"),
        ({**SLURM, "SLURM_JOB_ID": ""}, "SLURM environment: SLURM_JOB_ID='' is not a job number"),
    ],
)
def test_bad_variables_are_named(environ: dict[str, str], message: str) -> None:
    found = detect_environment(environ)
    with pytest.raises(InputError, match=message):
        found.rank()
        found.main_port()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not a valid cluster description"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "joins as chief or worker"),
    ],
)
def test_a_bad_tf_config_is_refused_clearly(text: str, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        TfConfigEnvironment({"TF_CONFIG": text}).world_size()


# --------------------------------------------------------------------------- the flags


def test_nproc_defaults_to_one_per_machine_or_to_what_the_launcher_started() -> None:
    local = LocalEnvironment({})
    assert default_replicas(local, None, nnodes=1) == 1
    assert default_replicas(local, None, nnodes=2) == 2
    assert default_replicas(local, 4, nnodes=2) == 4
    assert default_replicas(SlurmEnvironment(SLURM), None, nnodes=1) == 8
    assert default_replicas(TorchElasticEnvironment(TORCHRUN), 4, nnodes=1) == 4
    # and each is admitted: the flags agree with each other and with the environment
    check_cluster(local, 1)
    check_cluster(local, 2, nnodes=2, rdzv_endpoint="node0:29400")
    check_cluster(local, 4, nnodes=2, node_rank=1, rdzv_endpoint="node0:29400")
    check_cluster(SlurmEnvironment(SLURM), 8)
    check_cluster(TorchElasticEnvironment(TORCHRUN), 4)


@pytest.mark.parametrize(
    ("environ", "arguments", "message"),
    [
        ({}, {"nproc": 3, "nnodes": 2, "rdzv_endpoint": "h:1"}, "--nproc 3 is not a multiple of --nnodes 2"),
        ({}, {"nproc": 2, "nnodes": 2}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        ({}, {"nproc": 2, "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank 2: must be"),
        ({}, {"nproc": 2, "nnodes": 0}, "--nnodes 0: the number of machines must be at least 1"),
        ({}, {"nproc": 2, "nnodes": 2, "rdzv_endpoint": "node0"}, "--rdzv-endpoint 'node0': expected"),
        (
            {**TORCHRUN, "WORLD_SIZE": "2"},
            {"nproc": 3},
            "--nproc 3, but the torchrun environment says WORLD_SIZE=2",
        ),
        (SLURM, {"nproc": 3}, r"--nproc 3, but the SLURM environment \(SLURM_NTASKS=8\)"),
        (KUBEFLOW, {"nproc": 2}, r"--nproc 2, but the Kubeflow PyTorchJob environment \(WORLD_SIZE=3\)"),
        (TFJOB, {"nproc": 2}, "--nproc 2, but TF_CONFIG describes 3 workers"),
        # (--nproc a multiple of the processes: each holds several replicas, where the
        # backend can; torch refuses it, one process per replica: tests/torch/test_cli.py)
        (
            SLURM,
            {"nproc": 8, "nnodes": 2},
            r"--nnodes 2, but the SLURM environment \(SLURM_NTASKS=8\): it starts the processes",
        ),
    ],
)
def test_a_mismatch_is_an_error_naming_both(
    environ: dict[str, str], arguments: dict[str, object], message: str
) -> None:
    with pytest.raises(InputError, match=message):
        check_cluster(detect_environment(environ), **arguments)  # type: ignore[arg-type]


def test_an_endpoint_is_host_and_port() -> None:
    assert parse_endpoint("10.0.0.5:29400") == ("10.0.0.5", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)
    with pytest.raises(InputError, match="--rdzv-endpoint 'h:0'"):
        parse_endpoint("h:0")


@pytest.mark.parametrize(
    ("environ", "node_rank", "owns"),
    [
        ({}, 0, True),
        ({}, 1, False),  # another machine's launcher: node 0's minds the folder
        (SLURM, 0, False),  # task 5 of 8
        ({**SLURM, "SLURM_PROCID": "0"}, 0, True),
        (TFJOB, 0, False),
    ],
)
def test_only_rank_0_minds_the_run_folder(
    monkeypatch: pytest.MonkeyPatch,
    write_plan: Callable[..., Path],
    environ: dict[str, str],
    node_rank: int,
    owns: bool,
) -> None:
    from crosstrain.core.run.job import Job, LaunchOptions, Layout
    from crosstrain.core.spec.planfile import load_plan

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    job = Job(
        plan=load_plan(write_plan()),
        layout=Layout("torch", 1, nnodes=2),
        launch=LaunchOptions(nnodes=2, node_rank=node_rank),
    )
    assert owns_run_folder(job, detect_environment()) is owns
