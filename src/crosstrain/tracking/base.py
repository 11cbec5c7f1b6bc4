"""What every tracker shares: the hooks, rank 0 only, the run id kept in the run folder,
the parameters, the buffered metrics, the artifacts, and one warning on failure.

A tracker module supplies a :class:`TrackerClient` opener and its command-line option;
:class:`TrackerPlugin` does the rest, so MLflow and W&B log the same things the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from crosstrain.core.admission.runfolder import PLAN_FILE
from crosstrain.core.run.checkpoint import MODEL_FILE
from crosstrain.core.run.context import RunContext
from crosstrain.core.spec.plan_dicts import unstructure_plan
from crosstrain.plugins.hookspecs import hookimpl
from crosstrain.plugins.metrics import METRICS_FILE, SUMMARY_FILE
from crosstrain.plugins.progress import Throughput

#: the run folder's record of each tracker's run id: a resumed or continued run logs there
TRACKERS_FILE = "trackers.json"
#: the curve plot drawn for the trackers (when matplotlib is installed)
CURVES_FILE = "curves.png"
#: a parameter's value is cut to this many characters (a long layer list would not fit
#: a tracker's parameter; the whole plan is an artifact)
PARAMETER_CHARACTERS = 500
#: metrics are sent in batches: at most this many values, or this many seconds apart, and
#: at every evaluation, epoch end, checkpoint and the run's end
BATCH_VALUES, BATCH_SECONDS = 1000, 10.0
#: the frameworks whose versions are logged, where the run imported them
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "numpy")
_NOT_LOGGED = frozenset({"count"})  # an evaluation's row count is not a metric


class TrackerClient(Protocol):
    """One tracker run, opened by a tracker module's opener."""

    #: the tracker's id of this run, kept in trackers.json
    run_id: str

    def log_params(self, params: Mapping[str, str]) -> None: ...

    def log_metrics(self, steps: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Values by step, in step order."""

    def log_artifacts(self, files: Sequence[Path], summary: Mapping[str, Any]) -> None: ...

    def close(self, failed: bool) -> None: ...


#: opens the tracker run of ``context`` (``option``: the value given on the command line,
#: "" when none; ``run_id``: the id of a resumed or continued run's tracker run, else None)
Opener = Callable[[RunContext, str, str | None], TrackerClient]


def flat_parameters(context: RunContext) -> dict[str, str]:
    """The plan flattened to dotted names, the backend, the world and the frameworks'
    versions, each a string a tracker's parameter holds."""
    params = dict(_flattened(unstructure_plan(context.plan)))
    world = context.world
    params |= {
        "backend": context.backend,
        "world_size": str(world.replicas),
        "processes": str(world.process_count),
        "device": str(context.job.device),
    }
    for module in FRAMEWORKS:
        if module in sys.modules:
            params[f"version.{module}"] = str(getattr(sys.modules[module], "__version__", "?"))
    return {name: _cut(value) for name, value in params.items()}


def _flattened(raw: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in raw.items():
        if isinstance(value, Mapping) and value:
            yield from _flattened(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", json.dumps(value) if not isinstance(value, str) else value


def _cut(value: str) -> str:
    return value if len(value) <= PARAMETER_CHARACTERS else value[: PARAMETER_CHARACTERS - 1] + "…"


def read_run_ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / TRACKERS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def keep_run_id(run_dir: Path, tracker: str, run_id: str) -> None:
    ids = read_run_ids(run_dir) | {tracker: run_id}
    (run_dir / TRACKERS_FILE).write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")


class TrackerFlag(argparse.Action):
    """``--FLAG [VALUE]`` of a tracker: refused before any process starts when the tracker's
    package is not installed, naming the extra that brings it; stores VALUE, or "" when none
    is given (the tracker's default). ``module`` and ``extra`` come as keywords of
    ``add_argument``."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, module: str, extra: str, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, nargs="?", const="", default=None, **kwargs)
        self.module, self.extra = module, extra

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        if importlib.util.find_spec(self.module) is None:
            raise argparse.ArgumentError(
                self, f"needs the {self.module} package: pip install 'crosstrain[{self.extra}]'"
            )
        setattr(namespace, self.dest, values or "")


@attrs.frozen
class TrackerOption:
    """A tracker's ``--NAME [VALUE]``: the package it needs and the extra that brings it."""

    module: str
    extra: str
    metavar: str
    help: str


class TrackerPlugin:
    """A tracker as a crosstrain plugin, named ``name`` (its flag ``--NAME``, and the key in
    ``context.options``: None, the tracker is off; "", on with its default)."""

    def __init__(self, name: str, title: str, option: TrackerOption, open_client: Opener) -> None:
        self.name, self.title, self.option, self.open_client = name, title, option, open_client
        self._client: TrackerClient | None = None
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._pending_values = 0  # values in _pending
        self._sent_at = 0.0
        self._throughput: Throughput | None = None

    # ------------------------------------------------------------------ guarded calls

    def _guarded(self, what: str, call: Callable[[TrackerClient], None]) -> None:
        """Run ``call`` on the open client; a failure warns once and closes the tracker:
        the run goes on without it."""
        client = self._client
        if client is None:
            return
        try:
            call(client)
        except Exception as error:  # the tracker's own failure (server, disk) must not stop training
            self._client, self._pending, self._pending_values = None, [], 0
            self._warn(f"failed to {what}", error, "(metrics.jsonl has every value)")
            with contextlib.suppress(Exception):  # already warned: a broken tracker may fail again closing
                client.close(failed=True)

    def _warn(self, what: str, error: Exception, after: str = "") -> None:
        """One line on stderr: the tracker, what it could not do and the error on one line."""
        message = " ".join(f"{type(error).__name__}: {error}".split())
        line = f"crosstrain: warning: --{self.name} {what} ({message}); the run goes on without it"
        print(f"{line} {after}".rstrip(), file=sys.stderr, flush=True)

    def _send(self) -> None:
        pending, self._pending, self._pending_values = self._pending, [], 0
        self._sent_at = time.monotonic()
        if pending:
            self._guarded("log metrics", lambda client: client.log_metrics(pending))

    def _add(self, step: int, values: Mapping[str, float]) -> None:
        if self._client is None:
            return
        self._pending.append((step, dict(values)))
        self._pending_values += len(values)
        if self._pending_values >= BATCH_VALUES or time.monotonic() - self._sent_at >= BATCH_SECONDS:
            self._send()

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def crosstrain_addoption(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group(f"{self.title} (plugin {self.name})")
        option = self.option
        group.add_argument(
            f"--{self.name}",
            dest=self.name,
            action=TrackerFlag,
            module=option.module,
            extra=option.extra,
            metavar=option.metavar,
            help=f"{option.help}; put it after the plan file",
        )

    @hookimpl
    def crosstrain_train_start(self, context: RunContext) -> None:
        self._client, self._pending, self._pending_values = None, [], 0
        given = context.options.get(self.name)
        if given is None or not context.world.is_main:
            return
        run_id = read_run_ids(context.out_dir).get(self.name)
        try:
            self._client = self.open_client(context, str(given), run_id)
        except Exception as error:  # a tracker that cannot open is warned about, never fatal
            self._client = None
            self._warn("could not start", error)
            return
        keep_run_id(context.out_dir, self.name, self._client.run_id)
        self._throughput = Throughput(context)
        self._sent_at = time.monotonic()
        if run_id is None:  # a continued run keeps the parameters it started with
            params = flat_parameters(context)
            self._guarded("log parameters", lambda client: client.log_params(params))

    @hookimpl
    def crosstrain_step_end(
        self, context: RunContext, step: int, epoch: int, lr: float, metrics: Mapping[str, float]
    ) -> None:
        if self._client is None or self._throughput is None:
            return
        self._throughput.record(step)
        values = {name: float(value) for name, value in metrics.items()}
        self._add(step, {**values, "lr": lr, "samples_per_second": self._throughput.samples_per_second()})

    @hookimpl
    def crosstrain_eval_end(
        self, context: RunContext, step: int, epoch: int, metrics: Mapping[str, float]
    ) -> None:
        values = {f"eval_{name}": float(value) for name, value in metrics.items() if name not in _NOT_LOGGED}
        self._add(step, values)
        self._send()

    @hookimpl
    def crosstrain_epoch_end(self, context: RunContext, epoch: int, metrics: Mapping[str, float]) -> None:
        if self._throughput is not None:
            self._throughput.next_epoch()
        self._send()

    @hookimpl
    def crosstrain_checkpoint_saved(self, context: RunContext, path: str, step: int) -> None:
        self._send()

    @hookimpl(trylast=True)  # after the metrics plugin wrote summary.json
    def crosstrain_train_end(self, context: RunContext, summary: Mapping[str, Any]) -> None:
        self._send()
        if self._client is None:  # off, not rank 0, or failed
            return
        files = [context.out_dir / name for name in (PLAN_FILE, SUMMARY_FILE, MODEL_FILE)]
        with tempfile.TemporaryDirectory() as scratch:
            curves = _draw_curves(context.out_dir, Path(scratch) / CURVES_FILE)
            present = [path for path in [*files, curves] if path is not None and path.is_file()]
            self._guarded("log artifacts", lambda client: client.log_artifacts(present, summary))
        self._guarded("finish", lambda client: client.close(failed=False))
        self._client = None

    @hookimpl
    def crosstrain_exception(self, context: RunContext, rank: int, error: BaseException) -> None:
        self._send()
        self._guarded("finish", lambda client: client.close(failed=True))
        self._client = None


def _draw_curves(run_dir: Path, output: Path) -> Path | None:
    """The run's learning curves (crosstrain plot's figure), where matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None or not (run_dir / METRICS_FILE).is_file():
        return None
    from crosstrain.plot import plot_runs  # the figure's code, imported only when drawn

    return plot_runs([run_dir], output)
