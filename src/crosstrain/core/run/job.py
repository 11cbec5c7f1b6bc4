"""A job: what the user launched (the world each process stands in, the plugins it loads,
the layout its replicas run on) and the record every worker receives, picklable."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import pluggy

from crosstrain.core.spec.plan import Plan

DeviceChoice = Literal["auto", "cpu", "gpu"]


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
    nnodes: int = 1
    device: DeviceChoice = "auto"

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


@attrs.frozen
class Job:
    """Everything a worker needs to run the plan; picklable, sent to every process.

    ``replicas`` is the total number of model copies (``--nproc``); ``workers`` the number
    of processes (``--workers``), None letting the backend choose its natural layout.
    """

    plan: Plan
    backend: str
    replicas: int = 1
    workers: int | None = None
    device: DeviceChoice = "auto"
    out_dir: str = "runs/latest"
    options: Mapping[str, Any] = attrs.field(factory=dict)
    plugins: PluginSelection = PluginSelection()
    timeout_seconds: float = 300.0
    #: continue from the run folder's last complete checkpoint (from the start when it has
    #: none: a worker group restarted before its first checkpoint). The CLI's ``--resume``
    #: sets it; a launcher that restarts its workers sets it on the restarted ones.
    resume: bool = False
    #: the checkpoint folder a resumed run continues from, chosen and verified before launch
    #: (the newest intact one: :func:`crosstrain.core.admission.checks.admit` sets it), so every
    #: worker reads that one rather than searching again; None: the workers search (a
    #: restarted group continues from the newest checkpoint it wrote itself)
    resume_from: str | None = None
    #: a new run starts from these weights (a safetensors file under neutral names, checked
    #: against the plan's model before launch: ``--init-from``); the optimizer starts fresh
    #: at step 0, and the run evaluates the weights before its first step
    init_from: str | None = None
    #: how many times a launcher that can restart its workers (torch's elastic agent)
    #: restarts the whole group after a failure; each restart resumes
    max_restarts: int = 0
    #: machines crosstrain launches on (``--nnodes``), this one's index (``--node-rank``)
    #: and where they meet (``--rdzv-endpoint HOST:PORT``, node 0's); ``replicas`` counts
    #: the replicas on all of them
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    #: a table run's statistics as the admission computed them from its training rows (their
    #: JSON), which the run folder keeps: the table is read once before launch, not twice
    table_statistics: Mapping[str, Any] | None = None
    #: a run continued by ``--resume``: the layout its run folder recorded at its last launch
    #: (for the header line, which says whether it continues as it ran); None: a new run, or a
    #: folder written before runs recorded their layout
    resumed_layout: Layout | None = None
    #: how each worker loads ``plugins`` (:func:`crosstrain.core.run.worker.run_worker` calls it):
    #: set by ``crosstrain.api.make_job`` to the plugin manager's ``hook_relay``. Core may not
    #: import the manager, so whoever makes the job hands it down; a module-level function,
    #: so the job still pickles (by reference) to every process
    load_hooks: HookLoader | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.backend, self.replicas, self.workers, self.nnodes, self.device)


@attrs.frozen
class RunResult:
    """What launch returns: rank 0's summary (the same dict written to summary.json)."""

    summary: Mapping[str, Any]
    out_dir: str
