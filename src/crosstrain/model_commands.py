"""The `crosstrain` commands that take a run or a model already made: evaluate, predict and
export a run's model on any backend, and import a Keras or torch model as a plan."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from crosstrain.plugins.manager import CrosstrainPluginManager

_IN_PROCESS = "runs in this one process (world 1)"


def _quiet_tensorflow() -> None:
    """TensorFlow's settings for crosstrain's processes (its C++ start-up log off), in this
    one before a command may import it: ``import`` of a Keras model, ``export --format
    keras``, evaluate and predict on tf. A variable the user set is kept."""
    from crosstrain.backends.tf.runtime import quiet_tensorflow

    quiet_tensorflow()


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run folder written by crosstrain run")
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="NAME",
        help="a checkpoint of the run (step-NNNNNNNN or its step); default: the final model.safetensors",
    )


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default=None, help="registered backend name (default: the one that trained the run)"
    )
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")


def _add_inference_commands(commands: Any) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        help="the eval metrics of a run's model on any backend",
        description="Eval loss, accuracy and count over the plan's eval set, or over --data and "
        f"--labels; {_IN_PROCESS}.",
    )
    _add_model_arguments(evaluate)
    _add_backend_arguments(evaluate)
    evaluate.add_argument(
        "--data",
        default=None,
        metavar="X",
        help="rows to evaluate on instead: a .npy (raw, scaled as in training, with --labels) or, "
        "for a table run, a .csv/.parquet table with its label column",
    )
    evaluate.add_argument("--labels", default=None, metavar="Y.npy", help="their labels (or targets)")
    evaluate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    evaluate.set_defaults(handler=_evaluate)
    predict = commands.add_parser(
        "predict",
        help="a run's model outputs (logits) for the rows of a file",
        description=f"Rows scaled as in training; outputs written with np.save; {_IN_PROCESS}.",
    )
    _add_model_arguments(predict)
    _add_backend_arguments(predict)
    predict.add_argument(
        "--data",
        required=True,
        metavar="X",
        help="rows of model.input_shape (.npy); for runs that trained on them, an image, a folder of "
        "images or a .csv/.parquet table",
    )
    predict.add_argument("--out", required=True, metavar="PRED.npy", help="where the outputs go")
    predict.set_defaults(handler=_predict)
    export = commands.add_parser(
        "export",
        help="a run's model as files its framework loads without crosstrain",
        description="torch: model.pt2 (torch.export.load) and state_dict.pt; keras: model.keras "
        "(keras.saving.load_model). Float32, checked against crosstrain's outputs.",
    )
    _add_model_arguments(export)
    export.add_argument("--format", required=True, dest="format_name", help="torch or keras")
    export.add_argument("--out", default=None, help="an empty or new folder (default: RUN/export-FORMAT)")
    export.set_defaults(handler=_export)


def _evaluate(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    _quiet_tensorflow()
    from crosstrain.inference import evaluate_run, evaluation_rows

    result = evaluate_run(
        args.run, args.backend, args.checkpoint, args.device, manager, args.data, args.labels
    )
    if args.json:
        print(json.dumps(result, indent=2), flush=True)
        return 0
    table = Table(title=f"{result['run']} on {result['backend']}", show_header=False)
    given = [(name, result[name]) for name in ("data", "labels") if name in result]
    for name, value in [*evaluation_rows(result["eval"]), ("weights", result["weights"]), *given]:
        table.add_row(name, Text(value))
    console.print(table)
    return 0


def _predict(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    _quiet_tensorflow()
    from crosstrain.inference import predict_run

    outputs = predict_run(args.run, args.data, args.out, args.backend, args.checkpoint, args.device, manager)
    console.print(Text(f"{args.out}: outputs {list(outputs.shape)} ({outputs.dtype})"), soft_wrap=True)
    return 0


def _export(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    _quiet_tensorflow()
    from crosstrain.inference import export_run

    for path in export_run(args.run, args.format_name, args.out, args.checkpoint, manager):
        console.print(Text(str(path)), soft_wrap=True)  # a long path on one line, even in a pipe
    return 0


def _add_import_command(commands: Any) -> None:
    from crosstrain.importers import IMPORTERS

    importer = commands.add_parser(
        "import",
        help="a model made with a framework as a plan and its weights",
        description="A saved Keras 3 model (.keras), or a torch nn.Module made by module:factory "
        "(traced with torch.fx), becomes a TOML plan (layer names kept, graph edges as inputs) and its "
        "weights under neutral names, which the plan names as model.init. A layer without a plan "
        "equivalent is refused, naming it. docs/import.md.",
    )
    importer.add_argument(
        "source", help="the saved model (model.keras), or a torch module's factory (package.module:function)"
    )
    importer.add_argument("--out", required=True, metavar="PLAN.toml", help="the plan to write")
    importer.add_argument(
        "--weights",
        default=None,
        metavar="FILE.safetensors",
        help="where the weights go (default: init.safetensors beside the plan)",
    )
    importer.add_argument(
        "--framework",
        default=None,
        help=f"{' or '.join(sorted(IMPORTERS))} (default: from the file's suffix)",
    )
    importer.add_argument(
        "--input-shape",
        default=None,
        type=_sizes,
        metavar="H,W,C",
        help="a torch module's input: one row, channels-last (32,32,3 for torch's 3x32x32; 16: 16 token ids)",
    )
    importer.add_argument("--overwrite", action="store_true", help="replace the plan and weights files")
    importer.set_defaults(handler=_import)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(size) for size in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes separated by commas, as 32,32,3") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive")
    return sizes


def _import(args: argparse.Namespace, manager: CrosstrainPluginManager, console: Console) -> int:
    _quiet_tensorflow()
    from crosstrain.importers import import_model

    result = import_model(
        args.source,
        args.out,
        args.framework,
        args.weights,
        args.overwrite,
        say=lambda line: print(line),
        input_shape=args.input_shape,
    )
    console.print(
        Text(
            f"wrote {result.plan} ({result.layers} layers) and {result.weights} "
            f"({result.parameters:,} weights); train it: crosstrain run {result.plan} "
            f"(with [data] and [train] added)"
        ),
        soft_wrap=True,
    )
    return 0


def add_model_commands(commands: Any) -> None:
    """evaluate, predict, export and import, added to the CLI's sub-commands."""
    _add_inference_commands(commands)
    _add_import_command(commands)
