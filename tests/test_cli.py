"""The `crosstrain run` command line: each launch flag sets its field of the launch record
(crosstrain.LaunchOptions, which names the flags), and the plugins' options reach the job
as its options, nothing else."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest

from crosstrain import cli
from crosstrain.core.run.job import LaunchOptions, PluginSelection, RunResult
from crosstrain.plugins.manager import AUTOLOAD_OFF_VARIABLE
from tests.conftest import InProcessCli


@attrs.define
class Launched:
    """What `crosstrain run` handed to :func:`crosstrain.api.run_plan`."""

    plan: Any = None
    options: LaunchOptions | None = None
    overrides: list[str] = attrs.field(factory=list)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Launched:
    """`crosstrain run` records what it would launch instead of launching it."""
    seen = Launched()

    def run_plan(
        plan: Any, options: LaunchOptions, overrides: Iterable[str] = (), *_: Any, **__: Any
    ) -> RunResult:
        seen.plan, seen.options, seen.overrides = plan, options, list(overrides)
        return RunResult({}, "out")

    monkeypatch.setattr(cli, "run_plan", run_plan)
    monkeypatch.setattr(cli, "print_summary", lambda *_: None)
    return seen


def test_each_run_flag_sets_its_field_of_the_launch_record(
    cli_in_process: InProcessCli, launched: Launched
) -> None:
    result = cli_in_process(
        "run", "plan.toml", "--backend", "tf", "--nproc", "4", "--workers", "2", "--device", "cpu",
        "--out", "runs/a", "--set", "train.epochs=2", "--timeout", "7", "--resume",
        "--init-from", "runs/b", "--overwrite", "--max-restarts", "3", "--nnodes", "2",
        "--node-rank", "1", "--rdzv-endpoint", "node0:29500", "--patience", "5",
        env={AUTOLOAD_OFF_VARIABLE: None},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert launched.plan == "plan.toml" and launched.overrides == ["train.epochs=2"]
    assert launched.options is not None
    assert attrs.evolve(launched.options, options={}, plugins=PluginSelection()) == LaunchOptions(
        backend="tf",
        replicas=4,
        workers=2,
        device="cpu",
        out="runs/a",
        timeout_seconds=7.0,
        resume=True,
        max_restarts=3,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="node0:29500",
        init_from="runs/b",
        overwrite=True,
    )
    # the early_stop plugin's options, as its flags set them; no flag of crosstrain's own
    assert launched.options.options["patience"] == 5
    assert launched.options.options["early_stop"] is None
    crosstrain_own = {"plan", "overrides", "command", "handler", "plugins", "nproc", "timeout"}
    assert not crosstrain_own & set(launched.options.options)
    assert not set(attrs.fields_dict(LaunchOptions)) & set(launched.options.options)


def test_a_run_without_flags_asks_for_the_record_s_defaults(
    cli_in_process: InProcessCli, launched: Launched, tmp_path: Path
) -> None:
    """Left out, a flag is the record's default: the layout not given (resolved at launch),
    the timeout 300 s, no restarts, node 0."""
    # the plugins with options
    optional = ("early_stop", "tensorboard", "progress", "mlflow", "wandb", "sweep", "tune")
    blocked = [item for name in optional for item in ("-p", f"no:{name}")]
    result = cli_in_process(*blocked, "run", str(tmp_path / "p.toml"))
    assert result.returncode == 0, result.stderr
    assert launched.options is not None
    assert attrs.evolve(launched.options, plugins=PluginSelection()) == LaunchOptions()
    assert launched.options.timeout_seconds == 300.0
