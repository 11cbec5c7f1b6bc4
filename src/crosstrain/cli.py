"""The `crosstrain` command: run, backends (and whatever plugins add)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs
from rich.console import Console
from rich.table import Table
from rich.text import Text

from crosstrain.api import prepare_plan, run_plan
from crosstrain.core.errors import CrosstrainError, InputError, Interrupted, PlanError, WorkerError
from crosstrain.core.run.job import DEFAULT_BACKEND, DEFAULT_DEVICE, DEFAULT_NNODES, FLAG, LaunchOptions
from crosstrain.core.spec.plan import SHARD_MODES
from crosstrain.core.spec.vocabulary import SpeaksVocabulary
from crosstrain.launch import interrupts_raise
from crosstrain.launch.process import exit_now
from crosstrain.model_commands import add_model_commands
from crosstrain.plot import add_plot_command
from crosstrain.plugins.manager import (
    CrosstrainPluginManager,
    backend_registry,
    make_plugin_manager,
    report_failures,
    selection_from_args,
)
from crosstrain.sweep.command import add_sweep_command
from crosstrain.tuning.command import add_tune_command


def _plugin_args(argv: Sequence[str]) -> list[str]:
    """``-p`` values, read before the full parser exists (plugins add options to it)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("-p", dest="plugins", action="append", default=[])
    known, _ = early.parse_known_args(list(argv))
    return list(known.plugins)


#: how ``run --resume`` takes a layout flag that is not given: the run's own (its launch.json)
_AS_RUN = "; with --resume: the run's own"

#: the fields of the launch record a flag sets (its ``FLAG`` metadata names the flag)
_LAUNCH_FIELDS = {field.name: field for field in attrs.fields(LaunchOptions) if FLAG in field.metadata}


def _dest(flag: str) -> str:
    """The argparse dest of ``--a-flag``: ``a_flag``, as argparse derives it."""
    return flag.removeprefix("--").replace("-", "_")


def _add_launch_flag(parser: argparse.ArgumentParser, name: str, **settings: Any) -> None:
    """The flag that sets the launch record's field ``name``, defaulting to the field's
    default unless ``settings`` give another."""
    field = _LAUNCH_FIELDS[name]
    settings.setdefault("default", field.default)
    parser.add_argument(field.metadata[FLAG], **settings)


def _launch_options(args: argparse.Namespace, **unflagged: Any) -> LaunchOptions:
    """The launch record from the launch flags this command has (a field whose flag it
    lacks keeps its default); ``unflagged``: the fields no flag of their own sets."""
    dests = {name: _dest(field.metadata[FLAG]) for name, field in _LAUNCH_FIELDS.items()}
    given = {name: getattr(args, dest) for name, dest in dests.items() if hasattr(args, dest)}
    return LaunchOptions(**given, **unflagged)


def _add_run_arguments(parser: argparse.ArgumentParser, resumable: bool = False) -> None:
    """The options of a launch. ``resumable`` (``run``): the plan may be left out (``--resume``
    reads the run folder's own), ``--backend`` is given, and the layout flags default to None,
    "not given", which :func:`crosstrain.api.resolve_layout` resolves once (a resumed run's
    own layout, else the defaults the help names)."""
    if resumable:
        parser.add_argument(
            "plan", nargs="?", default=None, help="plan file (.toml or .py); with --resume, optional"
        )
    else:
        parser.add_argument("plan", help="plan file (.toml or .py)")
    as_run = _AS_RUN if resumable else ""
    if resumable:
        _add_launch_flag(
            parser, "backend", help=f"registered backend name (default: {DEFAULT_BACKEND}{as_run})"
        )
    _add_launch_flag(
        parser,
        "replicas",
        type=int,
        help="replicas (model copies) on all machines; default: 1 per machine, or what "
        f"torchrun/srun started{as_run}",
    )
    _add_launch_flag(
        parser,
        "workers",
        type=int,
        help=f"processes; default: the backend's natural layout{as_run} (with its backend and --nproc)",
    )
    _add_launch_flag(
        parser,
        "device",
        choices=("auto", "cpu", "gpu"),
        default=None if resumable else DEFAULT_DEVICE,
        help=f"default: {DEFAULT_DEVICE} (the GPUs when there are any){as_run}",
    )
    _add_launch_flag(parser, "out", help="output folder (default: a new one under runs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a plan field, e.g. --set optimizer.lr=0.01",
    )
    _add_launch_flag(
        parser,
        "timeout_seconds",
        type=float,
        help="seconds a rank may make no progress before the run is stopped (also the rendezvous's)",
    )


def _add_run_folder_arguments(parser: argparse.ArgumentParser) -> None:
    _add_launch_flag(
        parser,
        "resume",
        action="store_true",
        help="continue the run in --out from its newest intact checkpoint, with its own plan "
        "(plan.json) on its own layout (launch.json: --backend, --nproc, --workers, --nnodes, "
        "--device, each overridden by its flag); --set may change the output section, "
        "train.epochs, train.max_steps and train.shard",
    )
    _add_launch_flag(
        parser,
        "init_from",
        metavar="PATH",
        help="start a new run from another run's weights: RUN_DIR, RUN_DIR/checkpoints/step-N "
        "or a .safetensors file (the optimizer starts fresh)",
    )
    _add_launch_flag(
        parser, "overwrite", action="store_true", help="replace an earlier run in the run folder"
    )
    _add_launch_flag(
        parser,
        "max_restarts",
        type=int,
        metavar="N",
        help="restart a failed worker group up to N times from its last checkpoint",
    )


def _add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's names: the same command on each machine, only --node-rank differs."""
    _add_launch_flag(
        parser, "nnodes", type=int, metavar="N", help=f"machines (default: {DEFAULT_NNODES}{_AS_RUN})"
    )
    _add_launch_flag(parser, "node_rank", type=int, metavar="R", help="this machine's index, 0 to N-1")
    _add_launch_flag(
        parser,
        "rdzv_endpoint",
        metavar="HOST:PORT",
        help="where the machines meet: a free port on node 0 (needed with --nnodes > 1)",
    )


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    """The dests of the parser's arguments (argparse lists them only in ``_actions``)."""
    return {action.dest for action in parser._actions}


def build_parser(manager: CrosstrainPluginManager) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crosstrain", description=__doc__)
    parser.add_argument(
        "-p",
        dest="plugins",
        action="append",
        default=[],
        metavar="NAME",
        help="load plugin NAME; -p no:NAME blocks it",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train a plan")
    _add_run_arguments(run, resumable=True)
    _add_run_folder_arguments(run)
    _add_node_arguments(run)
    own = _dests(run)
    manager.hook.crosstrain_addoption(parser=run)
    run.set_defaults(handler=functools.partial(_run, plugin_options=sorted(_dests(run) - own)))
    compare = commands.add_parser(
        "compare",
        help="run a plan on several backends and compare, or compare finished runs",
        description="crosstrain compare PLAN --backends torch,tf [--seeds K]: run the plan on each "
        "backend (and K more seeds of the first) and judge; crosstrain compare RUN_DIR RUN_DIR ...: "
        "judge finished runs (a compare folder stands for its runs), the first the reference.",
    )
    _add_run_arguments(compare)
    compare.add_argument(
        "runs", nargs="*", metavar="RUN_DIR", help="with run folders instead of a plan: more runs to compare"
    )
    compare.add_argument(
        "--backends", default=None, help="comma-separated, the first is the reference (default: torch,tf)"
    )
    compare.add_argument(
        "--seeds",
        type=int,
        default=0,
        metavar="K",
        help="also run the reference backend with seeds seed+1..seed+K: the seed spread tells a drift "
        "(EQUIVALENT) from a bug (DIFFERENT); default 0 (off)",
    )
    compare.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest relative per-step (and eval) loss difference that agrees",
    )
    compare.add_argument(
        "--accuracy-tolerance",
        type=float,
        default=0.01,
        help="largest absolute eval-accuracy difference that agrees",
    )
    compare.add_argument(
        "--plot", default=None, metavar="IMAGE", help="also draw the runs' curves and differences into IMAGE"
    )
    compare.set_defaults(handler=functools.partial(_compare, plan_only=_plan_only_options(compare)))
    describe = commands.add_parser("describe", help="the model as a table: layers, shapes, parameters, FLOPs")
    describe.add_argument("plan", help="plan file (.toml or .py)")
    describe.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    describe.set_defaults(handler=_describe)
    backends = commands.add_parser("backends", help="list registered backends")
    backends.set_defaults(handler=_backends)
    add_plot_command(commands)
    add_sweep_command(commands)
    add_tune_command(commands)
    add_model_commands(commands)
    _add_data_command(commands)
    return parser


def _add_data_command(commands: Any) -> None:
    data = commands.add_parser("data", help="work on a plan's data ahead of its runs")
    actions = data.add_subparsers(dest="action", required=True)
    cache = actions.add_parser(
        "cache",
        help="decode an image plan's files once into data.cache (its runs then skip the decode)",
    )
    cache.add_argument("plan", help="plan file (.toml or .py) with data.source = 'images' and data.cache")
    cache.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    cache.add_argument(
        "--workers", type=int, default=None, help="decoding processes (default: this machine's cores)"
    )
    cache.set_defaults(handler=_data_cache)


def _data_cache(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    from crosstrain.core.data.sources.cache import write_cache
    from crosstrain.core.run.loading import image_files

    plan = prepare_plan(args.plan, args.overrides)
    if plan.data.source != "images":
        raise PlanError(
            f"{plan.data.source!r}: only image files are cached", field="data.source", source=plan.source
        )
    if plan.data.cache is None:
        raise PlanError("name the folder the cache goes in", field="data.cache", source=plan.source)
    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers {args.workers}: at least 1")
    paths = image_files(plan)
    written = write_cache(Path(plan.data.cache), paths, args.workers or os.cpu_count() or 1)
    line = f"{plan.data.cache}: {len(set(paths))} images decoded, {written / 1e6:,.1f} MB"
    console.print(Text(line), soft_wrap=True)
    return 0


def _run(
    args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console, plugin_options: list[str]
) -> int:
    """``plugin_options``: the dests of the options the plugins added (``crosstrain_addoption``)."""
    options = _launch_options(
        args,
        options={dest: getattr(args, dest) for dest in plugin_options},
        plugins=selection_from_args(args.plugins),
    )
    no_plan = (
        "run: no plan file; crosstrain run PLAN starts a run, crosstrain run --out DIR --resume "
        "continues the one in DIR"
    )
    result = run_plan(args.plan, options, args.overrides, manager, no_plan=no_plan)
    print_summary(console, result.summary, result.out_dir)
    return 0


#: compare's own options that say how to run a plan (besides the launch flags)
_COMPARE_PLAN_OPTIONS = ("--backends", "--seeds", "--set")


def _plan_only_options(compare: argparse.ArgumentParser) -> list[tuple[str, str, Any]]:
    """compare's options that say how to run a plan, refused with run folders (trained
    already), as (dest, flag, default): its own, then the launch flags it has."""
    launch_flags = [field.metadata[FLAG] for field in _LAUNCH_FIELDS.values()]
    named = {flag: action for action in compare._actions for flag in action.option_strings}
    return [
        (named[flag].dest, flag, named[flag].default)
        for flag in [*_COMPARE_PLAN_OPTIONS, *launch_flags]
        if flag in named
    ]


def _compare(
    args: argparse.Namespace,
    manager: CrosstrainPluginManager,
    console: Console,
    plan_only: list[tuple[str, str, Any]],
) -> int:
    from crosstrain.compare.folders import is_run_or_compare_folder, load_run_folders, not_a_run_folder
    from crosstrain.compare.launch import compare_plan
    from crosstrain.compare.table import print_comparison
    from crosstrain.plot import check_matplotlib, plot_runs

    first = Path(args.plan)
    if args.plot:
        check_matplotlib()  # before any run starts
    if is_run_or_compare_folder(first):
        given = [flag for dest, flag, default in plan_only if getattr(args, dest) != default]
        if given:
            raise InputError(f"{given[0]}: says how to run a plan; {first} holds runs trained already")
        drawn = [first, *map(Path, args.runs)]
        runs = load_run_folders(drawn)
    else:
        if first.is_dir():
            raise not_a_run_folder(first)
        if args.runs:
            raise InputError(
                f"{args.runs[0]}: compare takes one plan file, or run folders ({first} is a file)"
            )
        launch = _launch_options(args, plugins=selection_from_args(args.plugins))
        plan = prepare_plan(args.plan, args.overrides)
        runs, out_root = compare_plan(
            plan, args.backends or "torch,tf", manager, launch, args.seeds, args.tolerance
        )
        drawn = [out_root]
    verdict = print_comparison(console, runs, args.tolerance, args.accuracy_tolerance)
    if args.plot:
        console.print(f"wrote {plot_runs(drawn, args.plot)}", markup=False, soft_wrap=True)
    return verdict.exit_code


def _describe(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    from crosstrain.describe import print_description

    print_description(console, prepare_plan(args.plan, args.overrides))
    return 0


#: eval metrics a plan may ask for beyond loss and accuracy, shown only when it does
_LATER_METRICS = ("top_k_accuracy", "perplexity")


def print_summary(console: Console, summary: Mapping[str, Any], out_dir: str) -> None:
    table = Table(
        title=f"{summary['plan']} on {summary['backend']} x{summary['world_size']}", show_header=False
    )
    evaluation = summary.get("eval") or {}
    rows = [
        ("steps", f"{summary['steps']}"),
        ("train loss", f"{summary['train']['loss']:.4f}"),
        ("eval loss", f"{evaluation['loss']:.4f}" if "loss" in evaluation else "-"),
        ("eval accuracy", f"{evaluation['accuracy']:.4f}" if "accuracy" in evaluation else "-"),
        *[
            (f"eval {name.replace('_', ' ')}", f"{evaluation[name]:.4f}")
            for name in _LATER_METRICS
            if name in evaluation
        ],
        ("samples/s", f"{summary['samples_per_second']:.0f}"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
        *_rank_rows(summary.get("ranks") or []),
        *_memory_rows(summary.get("memory_per_rank")),
        *_stop_rows(summary),
        ("output", out_dir),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def _rank_rows(ranks: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Rank 0's time split, and the largest peak device memory of any rank."""
    if not ranks:
        return []
    first = ranks[0]
    rows = [("data / steps", f"{first['data_seconds']:.2f} s / {first['step_seconds']:.2f} s (rank 0)")]
    peaks = [rank["peak_device_memory_bytes"] for rank in ranks if rank.get("peak_device_memory_bytes")]
    if peaks:
        rows.append(("peak device memory", f"{max(peaks) / 2**30:.2f} GiB"))
    utilisation = first.get("gpu_utilisation_percent")
    if utilisation is not None:
        rows.append(("GPU utilisation", f"{utilisation:.0f} % (rank 0)"))
    return rows


def _memory_rows(memory: Mapping[str, int] | None) -> list[tuple[str, str]]:
    """What the rank holding the most holds of the training state (``train.shard`` divides it)."""
    if not memory:
        return []
    parts = " + ".join(f"{_bytes(memory[part])} {part}" for part in ("parameters", "gradients", "optimizer"))
    return [("memory per rank", f"{_bytes(sum(memory.values()))} ({parts})")]


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def _stop_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Why the run ended early and where it resumed from, when it did."""
    rows = []
    if summary.get("resumed_from_step"):
        rows.append(("resumed from step", str(summary["resumed_from_step"])))
    stopped = summary.get("stopped")
    if stopped:
        rows.append(("stopped", f"step {stopped['step']}: {stopped['reason']}"))
    return rows


def _backends(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    table = Table(title="crosstrain backends")
    for column in ("backend", "distribution", "framework", "devices", "train.shard"):
        table.add_column(column)
    for name, entry in sorted(backend_registry(manager).items()):
        status = entry.strategy.framework_status()
        framework = status.version if status.importable else f"missing: {entry.strategy.install_hint}"
        shard = _shard_modes(entry.strategy) if status.importable else "-"
        # Text, not markup: "crosstrain[torch]" must not be read as a rich style tag
        cells = (name, entry.distribution, framework, ", ".join(status.devices) or "-", shard)
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)
    return 0


def _shard_modes(strategy: type[Any]) -> str:
    """The ``train.shard`` modes a backend declares (a backend without a vocabulary: none)."""
    declared = strategy.vocabulary().shard if issubclass(strategy, SpeaksVocabulary) else {"none"}
    return ", ".join(mode for mode in SHARD_MODES if mode in declared)


def _print_error(message: str) -> None:
    # plain print, not rich: a message must never be wrapped mid-path or styled into a pipe
    print(message, file=sys.stderr, flush=True)


def _print_worker_error(error: WorkerError) -> None:
    """A crash: the failing rank's traceback, once, unwrapped, then its line. Bad input: the
    line alone (it names the file or field and the rank), with where its traceback was kept."""
    if error.bad_input and error.log is not None:
        _print_error(f"crosstrain: error: {error} (traceback: {error.log})")
        return
    if error.traceback_text:
        sys.stderr.write(error.traceback_text.rstrip() + "\n")
    _print_error(f"crosstrain: error: {error}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with interrupts_raise():  # SIGTERM ends the CLI as Ctrl-C does: 143, one line
            manager = make_plugin_manager(selection_from_args(_plugin_args(argv)))
            report_failures(manager)
            args = build_parser(manager).parse_args(argv)
            return int(args.handler(args, manager, Console(highlight=False)))
    except Interrupted as error:
        _print_error("crosstrain: interrupted")
        return error.exit_code
    except WorkerError as error:
        _print_worker_error(error)
        return error.exit_code
    except CrosstrainError as error:
        _print_error(f"crosstrain: error: {error}")
        return error.exit_code
    except KeyboardInterrupt:
        _print_error("crosstrain: interrupted")
        return 130


def run() -> NoReturn:
    """The ``crosstrain`` command: :func:`main`, then exit at once with its code (no
    interpreter teardown of the frameworks it imported: :func:`exit_now`)."""
    try:
        code = main()
    except SystemExit as stop:  # argparse's --help (0) and usage errors (2)
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message"): the message, exit 1, as Python ends it
            print(stop.code, file=sys.stderr)
            code = 1
    exit_now(code)


if __name__ == "__main__":
    run()
