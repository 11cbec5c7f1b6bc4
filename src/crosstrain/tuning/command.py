"""``crosstrain tune PLAN --lr [--write PLAN_OUT]`` and ``crosstrain tune PLAN --batch``:
the command line of :mod:`crosstrain.tuning`. Both run the plan itself, in this process's
launcher, on any backend (``--backend``, ``--nproc``, ``--device``, ``--set`` as ``run``
takes them), into ``--out`` (default ``runs/PLAN_NAME-tune``)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import attrs
import tomlkit
from rich.console import Console
from rich.table import Table
from rich.text import Text

from crosstrain.api import make_job, prepare_plan, run_job
from crosstrain.core.errors import CrosstrainError, InputError, NonFiniteLossError
from crosstrain.core.run.job import LaunchOptions
from crosstrain.core.spec.plan import Plan
from crosstrain.launch.gpus import count_gpus
from crosstrain.plugins.manager import CrosstrainPluginManager, make_plugin_manager, selection_from_args
from crosstrain.tuning.batch import PROBE_STEPS, is_out_of_memory, largest_micro_batch, split_global_batch
from crosstrain.tuning.divergence import OPTION as DIVERGENCE_OPTION
from crosstrain.tuning.lr_range import PLOT_FILE, RangeTest, curve_rows, draw_curve, read_curve

#: what the tuning runs leave out: the progress line (tune prints its own), and the
#: trackers (a probe is no experiment)
QUIET = ("progress", "mlflow", "wandb")


def add_tune_command(commands: Any) -> None:
    tune = commands.add_parser(
        "tune",
        help="find a plan's learning rate (--lr: a range test) or largest micro-batch (--batch, on a GPU)",
        description="crosstrain tune PLAN --lr [--write PLAN_OUT]: a learning-rate range test from the "
        "plan's initial weights, its curve, a suggested rate and a plot; crosstrain tune PLAN --batch: "
        "the largest micro-batch a GPU holds, and the train.grad_accum_steps that keeps the plan's "
        "global_batch_size.",
    )
    tune.add_argument("plan", help="plan file (.toml or .py)")
    what = tune.add_mutually_exclusive_group(required=True)
    what.add_argument("--lr", action="store_true", help="run the learning-rate range test")
    what.add_argument("--batch", action="store_true", help="find the largest micro-batch that fits (a GPU)")
    tune.add_argument(
        "--write", default=None, metavar="PLAN_OUT", help="a copy of the plan with what was found"
    )
    tests = RangeTest()
    tune.add_argument(
        "--min-lr", type=float, default=tests.min_lr, help=f"--lr: the first rate ({tests.min_lr})"
    )
    tune.add_argument(
        "--max-lr", type=float, default=tests.max_lr, help=f"--lr: the last rate ({tests.max_lr})"
    )
    tune.add_argument(
        "--steps",
        type=int,
        default=tests.steps,
        help=f"--lr: steps from the first to the last ({tests.steps})",
    )
    tune.add_argument(
        "--out", default=None, help="the folder of the tuning runs (default: runs/PLAN_NAME-tune)"
    )
    tune.add_argument("--backend", default=None, help="the backend (default: crosstrain run's)")
    tune.add_argument("--nproc", type=int, default=None, help="replicas")
    tune.add_argument("--device", choices=("auto", "cpu", "gpu"), default=None, help="the device")
    tune.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    tune.set_defaults(handler=_tune)


def _tune(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    plan = prepare_plan(args.plan, args.overrides)
    if args.write is not None and Path(args.write).resolve() == Path(args.plan).resolve():
        raise InputError(f"--write {args.write}: that is the plan itself; name a copy")
    out = Path(args.out) if args.out else Path("runs") / f"{plan.name}-tune"
    selection = selection_from_args(args.plugins)
    selection = attrs.evolve(selection, disabled=(*selection.disabled, *QUIET))
    launch = LaunchOptions(backend=args.backend, replicas=args.nproc, device=args.device, plugins=selection)
    if args.lr:
        return _tune_lr(args, plan, out, launch, console)
    return _tune_batch(args, plan, out, launch, console)


def _tune_lr(
    args: argparse.Namespace,
    plan: Plan,
    out: Path,
    launch: LaunchOptions,
    console: Console,
) -> int:
    test = RangeTest(args.min_lr, args.max_lr, args.steps)
    tested = _without_checkpoints(prepare_plan(args.plan, [*args.overrides, *test.overrides()]))
    options = attrs.evolve(launch, out=out, overwrite=True, options={DIVERGENCE_OPTION: test.divergence})
    # a non-finite loss ends the test as a divergence does: the curve is what came before
    with contextlib.suppress(NonFiniteLossError):
        run_job(make_job(tested, options), make_plugin_manager(options.plugins))
    curve = read_curve(out)
    suggestion = curve.suggestion
    table = Table(title=f"learning-rate range test: {plan.name}, {len(curve.lrs)} steps")
    for column in ("step", "lr", "smoothed loss"):
        table.add_column(column, justify="right")
    for step, lr, loss in curve_rows(curve):
        table.add_row(str(step), f"{lr:.3g}", f"{loss:.4f}")
    console.print(table)
    drawn = draw_curve(curve, out / PLOT_FILE, f"learning-rate range test: {plan.name}")
    say = [f"suggested optimizer.lr = {suggestion:.3g} (the plan has {plan.optimizer.lr:.3g})"]
    if drawn is not None:
        say.append(f"plot: {drawn}")
    if args.write is not None:
        rate = {"optimizer": {"lr": float(f"{suggestion:.3g}")}}
        say.append(f"wrote {write_plan_copy(Path(args.plan), Path(args.write), rate)}")
    for line in say:
        console.print(Text(line), soft_wrap=True)
    return 0


def _tune_batch(
    args: argparse.Namespace,
    plan: Plan,
    out: Path,
    launch: LaunchOptions,
    console: Console,
) -> int:
    if args.device == "cpu" or count_gpus() == 0:
        raise InputError(
            "tune --batch finds what fits a GPU's memory, and this run has no GPU (on a CPU the "
            "batch is bounded by time, not memory: keep the plan's global_batch_size)"
        )
    replicas = args.nproc or 1
    train = plan.train
    per_replica = train.global_batch_size // replicas
    start = max(1, per_replica // train.grad_accum_steps)
    manager = make_plugin_manager(launch.plugins)

    def fits(micro_batch: int) -> bool:
        probe = prepare_plan(
            args.plan,
            [
                *args.overrides,
                f"train.global_batch_size={micro_batch * replicas}",
                "train.grad_accum_steps=1",
                f"train.max_steps={PROBE_STEPS}",
                "train.epochs=1000000",
                "train.eval_every_epochs=0",
            ],
        )
        options = attrs.evolve(launch, out=out / f"batch-{micro_batch}", overwrite=True)
        try:
            run_job(make_job(_without_checkpoints(probe), options), manager)
        except CrosstrainError as error:
            if is_out_of_memory(str(error)):
                console.print(Text(f"micro-batch {micro_batch}: out of memory"), soft_wrap=True)
                return False
            raise
        console.print(Text(f"micro-batch {micro_batch}: fits"), soft_wrap=True)
        return True

    largest = largest_micro_batch(start, fits, per_replica)
    if largest == 0:
        raise InputError("tune --batch: not even a micro-batch of 1 row fits the GPU")
    found = split_global_batch(train.global_batch_size, replicas, largest)
    console.print(
        Text(
            f"largest micro-batch that fits: {found.largest} rows per replica; global_batch_size "
            f"{train.global_batch_size} = {replicas} replicas x train.grad_accum_steps "
            f"{found.grad_accum_steps} x {found.micro_batch} rows"
        ),
        soft_wrap=True,
    )
    if args.write is not None:
        change = {"train": {"grad_accum_steps": found.grad_accum_steps}}
        console.print(
            Text(f"wrote {write_plan_copy(Path(args.plan), Path(args.write), change)}"), soft_wrap=True
        )
    return 0


def _without_checkpoints(plan: Plan) -> Plan:
    """A tuning run keeps no checkpoints: it is thrown away."""
    return attrs.evolve(plan, output=attrs.evolve(plan.output, checkpoint_every_steps=None, keep_best=None))


def write_plan_copy(plan: Path, output: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """A copy of a TOML plan (its comments kept) with ``changes`` (section -> field -> value);
    a Python plan's copy is its plan as TOML."""
    if plan.suffix == ".toml":
        document = tomlkit.parse(plan.read_text(encoding="utf-8"))
    else:
        from crosstrain.sweep.report import plan_document

        document = plan_document(prepare_plan(plan), f"{plan} as TOML")
    for section, fields in changes.items():
        if section not in document:
            document[section] = tomlkit.table()
        for name, value in fields.items():
            document[section][name] = value
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(tomlkit.dumps(document), encoding="utf-8")
    return output
