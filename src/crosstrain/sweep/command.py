"""``crosstrain sweep PLAN --trials N --search FIELD=SPACE ... --objective METRIC``: the
command line of :mod:`crosstrain.sweep`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from crosstrain.api import prepare_plan
from crosstrain.core.errors import InputError
from crosstrain.plugins.manager import CrosstrainPluginManager
from crosstrain.sweep.report import draw_sweep, trials_table, write_best_plan
from crosstrain.sweep.space import OBJECTIVES, SPACES
from crosstrain.sweep.study import SweepSettings
from crosstrain.sweep.trials import run_trials

DEFAULT_ROOT = "sweeps"
#: the launch flags a sweep hands to every trial, as (dest, flag)
RUN_FLAGS = (("backend", "--backend"), ("nproc", "--nproc"), ("workers", "--workers"), ("device", "--device"))


def add_sweep_command(commands: Any) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="search a plan's fields on Optuna: each trial a run, the study in sqlite",
        description="crosstrain sweep PLAN --trials N --search FIELD=SPACE ... --objective METRIC: "
        "runs trials (each an ordinary run under OUT/trials/) until the study in OUT/study.sqlite "
        "holds N; the same command again continues it. At the end: the table, OUT/best.toml and "
        "OUT/sweep.png.",
    )
    sweep.add_argument("plan", help="plan file (.toml or .py)")
    sweep.add_argument(
        "--trials", type=int, required=True, metavar="N", help="trials the study holds at the end"
    )
    kinds = ", ".join(f"{kind}{SPACES[kind].arguments}" for kind in SPACES)
    sweep.add_argument(
        "--search",
        dest="searches",
        action="append",
        default=[],
        metavar="FIELD=SPACE",
        help=f"a plan field and its space: {kinds}; e.g. optimizer.lr=log(1e-4,1e-1)",
    )
    sweep.add_argument(
        "--objective",
        default="eval_loss",
        choices=list(OBJECTIVES),
        help="what to optimize (default eval_loss)",
    )
    sweep.add_argument("--parallel", type=int, default=1, metavar="K", help="trials at once (default 1)")
    sweep.add_argument("--out", default=None, help=f"the sweep folder (default: {DEFAULT_ROOT}/PLAN_NAME)")
    sweep.add_argument("--backend", default=None, help="every trial's backend (default: crosstrain run's)")
    sweep.add_argument("--nproc", type=int, default=None, help="every trial's replicas")
    sweep.add_argument("--workers", type=int, default=None, help="every trial's processes")
    sweep.add_argument("--device", choices=("auto", "cpu", "gpu"), default=None, help="every trial's device")
    sweep.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="fixed for every trial",
    )
    sweep.set_defaults(handler=_sweep)


def _sweep(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    if importlib.util.find_spec("optuna") is None:
        raise InputError("crosstrain sweep needs Optuna: pip install 'crosstrain[sweep]'")
    if args.trials < 1:
        raise InputError(f"--trials {args.trials}: at least 1")
    if args.parallel < 1:
        raise InputError(f"--parallel {args.parallel}: at least 1")
    plan = prepare_plan(args.plan, args.overrides)
    out = Path(args.out) if args.out else Path(DEFAULT_ROOT) / plan.name
    flags = [
        item
        for dest, flag in RUN_FLAGS
        if getattr(args, dest) is not None
        for item in (flag, str(getattr(args, dest)))
    ]
    settings = SweepSettings(
        plan=str(Path(args.plan).resolve()),
        objective=args.objective,
        searches=tuple(args.searches),
        overrides=tuple(args.overrides),
        run_flags=tuple(flags),
        plugin_args=tuple(args.plugins),
    )

    def say(line: str) -> None:
        console.print(Text(line), soft_wrap=True)

    study = run_trials(settings, out, args.trials, args.parallel, args.device, say)
    console.print(trials_table(study, args.objective))
    best = write_best_plan(study, out)
    drawn = draw_sweep(study, out, args.objective)
    if best is not None:
        say(f"best: trial {study.best_trial.number}, {args.objective} {study.best_value:.6g}; wrote {best}")
    else:
        say("no trial completed: no best.toml")
    if drawn is None:
        print("crosstrain: sweep.png needs matplotlib: pip install 'crosstrain[plot]'", file=sys.stderr)
    return 0
