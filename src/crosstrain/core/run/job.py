"""A job: what the user asked for at launch (:class:`LaunchOptions`, the one record of it),
what was resolved on top (the layout its replicas run on, the run folder, the checkpoint
resumed from), and the world each process stands in; the job is picklable, sent to every
worker."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import pluggy

from crosstrain.core.spec.plan import Plan

DeviceChoice = Literal["auto", "cpu", "gpu"]

#: what a launch takes where no flag says (``--nproc``:
#: :func:`~crosstrain.core.admission.cluster.default_replicas`; ``--workers``: the backend's
#: natural layout)
DEFAULT_BACKEND = "torch"
DEFAULT_DEVICE: DeviceChoice = "auto"
DEFAULT_NNODES = 1
DEFAULT_TIMEOUT_SECONDS = 300.0


@attrs.frozen
class World:
    """Where this process stands. A replica is one model copy; a process holds one
    (torch DDP) or several (tf MirroredStrategy) of them."""

    process_index: int = 0
    process_count: int = 1
    local_replicas: int = 1
    device: str = "cpu"

    @property
    def replicas(self) -> int:
        return self.process_count * self.local_replicas

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    @property
    def rank(self) -> int:
        return self.process_index


@attrs.frozen
class PluginSelection:
    """Which plugins a process loads: the same rules in the CLI and in every worker."""

    autoload: bool = True
    enabled: tuple[str, ...] = ()
    disabled: tuple[str, ...] = ()


#: turns a process's plugin selection into the hook relay the loop calls; the plugin
#: manager's :func:`crosstrain.plugins.manager.hook_relay` (core sits below the manager)
HookLoader = Callable[[PluginSelection], pluggy.HookRelay]


@attrs.frozen
class Layout:
    """Where a run's replicas run: what ``--backend``, ``--nproc``, ``--workers``,
    ``--nnodes`` and ``--device`` chose (``replicas`` as resolved; ``workers`` None: the
    backend's natural layout). A run folder records it at each launch, and a bare
    ``--resume`` continues on it."""

    backend: str
    replicas: int
    workers: int | None = None
    nnodes: int = DEFAULT_NNODES
    device: DeviceChoice = DEFAULT_DEVICE

    def differences(self, before: Layout) -> list[str]:
        """What ``before`` had where this layout differs, as the flags name it
        (``torch x2``, ``--workers 2``, ``--nnodes 2``, ``--device gpu``); [] if the same."""
        was = []
        if (self.backend, self.replicas) != (before.backend, before.replicas):
            was.append(f"{before.backend} x{before.replicas}")
        if self.workers != before.workers:
            was.append(f"--workers {before.workers}" if before.workers is not None else "--workers unset")
        if self.nnodes != before.nnodes:
            was.append(f"--nnodes {before.nnodes}")
        if self.device != before.device:
            was.append(f"--device {before.device}")
        return was


#: the key of a :class:`LaunchOptions` field's metadata that names the ``crosstrain run`` flag
#: setting it; the CLI builds its launch flags and the record from these
FLAG = "flag"


def _plain_dict(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy as a plain dict: the record pickles to every worker (a mapping proxy would not)."""
    return dict(values)


@attrs.frozen
class LaunchOptions:
    """What the user asked for at launch, as given: the ``crosstrain run`` flags (each field's
    ``FLAG`` metadata names its flag) and ``crosstrain.fit``'s keywords, as one record. The
    layout fields (``backend``, ``replicas``, ``workers``, ``device``, ``nnodes``) None: not
    given, resolved once where the job is made (a resumed run's own layout, else the
    defaults); a :class:`Job` holds the resolved layout. ``out`` None: the plan's
    ``output.dir``, else a new folder under runs/."""

    backend: str | None = attrs.field(default=None, metadata={FLAG: "--backend"})
    replicas: int | None = attrs.field(default=None, metadata={FLAG: "--nproc"})
    workers: int | None = attrs.field(default=None, metadata={FLAG: "--workers"})
    device: DeviceChoice | None = attrs.field(default=None, metadata={FLAG: "--device"})
    out: str | Path | None = attrs.field(default=None, metadata={FLAG: "--out"})
    #: plugins' option values (their argparse dests), reaching every hook as ``context.options``
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_plain_dict)
    #: which plugins every process loads (``-p``)
    plugins: PluginSelection = PluginSelection()
    #: seconds a rank may make no progress before the run is stopped; also bounds a
    #: cluster's rendezvous
    timeout_seconds: float = attrs.field(default=DEFAULT_TIMEOUT_SECONDS, metadata={FLAG: "--timeout"})
    #: continue the run folder's run from its last complete checkpoint (from the start when
    #: it has none: a worker group restarted before its first checkpoint); a launcher that
    #: restarts its workers sets it on the restarted ones
    #: (:func:`crosstrain.core.run.worker.attempt_job`)
    resume: bool = attrs.field(default=False, metadata={FLAG: "--resume"})
    #: how many times a launcher that can restart its workers (torch's elastic agent)
    #: restarts the whole group after a failure; each restart resumes
    max_restarts: int = attrs.field(default=0, metadata={FLAG: "--max-restarts"})
    #: machines crosstrain launches on, this one's index and where they meet (node 0's
    #: HOST:PORT); ``replicas`` counts the replicas on all of them
    nnodes: int | None = attrs.field(default=None, metadata={FLAG: "--nnodes"})
    node_rank: int = attrs.field(default=0, metadata={FLAG: "--node-rank"})
    rdzv_endpoint: str = attrs.field(default="", metadata={FLAG: "--rdzv-endpoint"})
    #: start a new run from these weights: a run folder, one of its checkpoints, or a
    #: .safetensors file under neutral names
    init_from: str | Path | None = attrs.field(default=None, metadata={FLAG: "--init-from"})
    #: replace an earlier run in the run folder
    overwrite: bool = attrs.field(default=False, metadata={FLAG: "--overwrite"})


@attrs.frozen
class Job:
    """Everything a worker needs to run the plan; picklable, sent to every process.

    ``launch`` is what the user asked for, as given; the rest is resolved on top of it.
    The resolved layout is read through ``backend``, ``replicas`` (the total number of model
    copies), ``workers`` (processes; None: the backend's natural layout), ``device`` and
    ``nnodes``: ``launch``'s own layout fields may be None (not given).
    """

    plan: Plan
    #: the layout the replicas run on, each part resolved once: the flag given, else a
    #: resumed run's own, else the default
    layout: Layout
    launch: LaunchOptions = LaunchOptions()
    #: the run folder, absolute: ``launch.out``, else the plan's ``output.dir``, else a new one
    out_dir: str = "runs/latest"
    #: the checkpoint folder a resumed run continues from, chosen and verified before launch
    #: (the newest intact one: :func:`crosstrain.core.admission.checks.admit` sets it), so every
    #: worker reads that one rather than searching again; None: the workers search (a
    #: restarted group continues from the newest checkpoint it wrote itself)
    resume_from: str | None = None
    #: a new run starts from these weights (``launch.init_from`` resolved to a safetensors
    #: file under neutral names, checked against the plan's model before launch); the
    #: optimizer starts fresh at step 0, and the run evaluates the weights before its first step
    init_from: str | None = None
    #: a table run's statistics as the admission computed them from its training rows (their
    #: JSON), which the run folder keeps: the table is read once before launch, not twice
    table_statistics: Mapping[str, Any] | None = None
    #: a run continued by ``--resume``: the layout its run folder recorded at its last launch
    #: (for the header line, which says whether it continues as it ran); None: a new run, or a
    #: folder written before runs recorded their layout
    resumed_layout: Layout | None = None
    #: how each worker loads ``launch.plugins`` (:func:`crosstrain.core.run.worker.run_worker`
    #: calls it): set by ``crosstrain.api.make_job`` to the plugin manager's ``hook_relay``.
    #: Core may not import the manager, so whoever makes the job hands it down; a
    #: module-level function, so the job still pickles (by reference) to every process
    load_hooks: HookLoader | None = None

    @property
    def backend(self) -> str:
        return self.layout.backend

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    @property
    def workers(self) -> int | None:
        return self.layout.workers

    @property
    def device(self) -> DeviceChoice:
        return self.layout.device

    @property
    def nnodes(self) -> int:
        return self.layout.nnodes


@attrs.frozen
class RunResult:
    """What launch returns: rank 0's summary (the same dict written to summary.json)."""

    summary: Mapping[str, Any]
    out_dir: str
