"""``crosstrain compare PLAN``: the plan on each backend, each into its own subfolder of the
compare folder, ``--seeds K`` more runs of the reference backend (the first) at seeds
seed+1..seed+K, and each backend's fp64 probe (its first steps in fp64); every run is
admitted before the first starts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from crosstrain.api import default_out_dir, make_job, run_job
from crosstrain.compare.difference import BackendRun, ComparedRuns
from crosstrain.compare.folders import ListedRun, read_step_losses, sorted_runs, write_compare_file
from crosstrain.compare.verdict import probe_plan
from crosstrain.core.admission.checks import admit
from crosstrain.core.errors import CrosstrainError, InputError
from crosstrain.core.run.job import LaunchOptions
from crosstrain.core.spec.plan import Plan
from crosstrain.launch.environments import detect_environment
from crosstrain.plugins.manager import CrosstrainPluginManager, get_backend
from crosstrain.plugins.metrics import METRICS_FILE

# compare reads each run's per-step losses from what this plugin writes
METRICS_PLUGIN = "metrics"


def plan_runs(backends: Sequence[str], seed: int, seeds: int, probes: bool = False) -> list[ListedRun]:
    """The runs of a compare: each backend (the first the reference) into a folder of its
    name (name-index where one backend runs twice: a determinism check must not share, and
    append to, one folder), then the reference backend at seeds seed+1..seed+K, then, with
    ``probes``, each backend's fp64 probe into its folder's name with ``-fp64``."""
    if len(backends) < 2:
        raise CrosstrainError("compare needs at least two backends, e.g. --backends torch,tf")
    if seeds < 0:
        raise InputError(f"--seeds {seeds}: must be 0 (off) or more")
    compared = [
        ListedRun(
            backend,
            backend if backends.count(backend) == 1 else f"{backend}-{index}",
            "reference" if index == 0 else "candidate",
            seed,
        )
        for index, backend in enumerate(backends)
    ]
    seed_runs = [
        ListedRun(backends[0], f"{backends[0]}-seed{seed + offset}", "seed", seed + offset)
        for offset in range(1, seeds + 1)
    ]
    fp64 = [ListedRun(run.backend, f"{run.folder}-fp64", "fp64", seed, run.folder) for run in compared]
    return [*compared, *seed_runs, *(fp64 if probes else [])]


def run_backends(
    plan: Plan,
    backends: Sequence[str],
    manager: CrosstrainPluginManager,
    out_root: Path,
    launch: LaunchOptions = LaunchOptions(),
    seeds: int = 0,
    tolerance: float = 1e-4,
) -> ComparedRuns:
    """Run the plan once per backend, each into ``out_root/FOLDER``, ``seeds`` more times
    on the reference backend, and each backend's first steps in fp64; every run is admitted
    before the first starts, and the probes (two steps each) run first. Each run is
    ``launch`` with its backend and folder."""
    if METRICS_PLUGIN in launch.plugins.disabled:
        raise InputError(
            f"compare reads each run's per-step losses from {METRICS_FILE}, which the "
            f"{METRICS_PLUGIN!r} plugin writes: drop -p no:{METRICS_PLUGIN}"
        )
    probe = probe_plan(plan)
    listed = plan_runs(backends, plan.seed, seeds, probes=probe is not None)
    cluster = detect_environment()
    jobs = []
    for run in listed:
        options = attrs.evolve(launch, backend=run.backend, out=out_root / run.folder)
        job = make_job(
            probe if run.role == "fp64" and probe else attrs.evolve(plan, seed=run.seed), options, cluster
        )
        admit(job, get_backend(manager, run.backend)(), cluster)
        jobs.append(job)
    write_compare_file(out_root, plan.name, listed, tolerance)
    summaries = {}
    for index in sorted(range(len(listed)), key=lambda index: listed[index].role != "fp64"):
        summaries[index] = run_job(jobs[index], manager)
    finished = [
        BackendRun(run.backend, summaries[index], read_step_losses(Path(job.out_dir)), run.seed, run.folder)
        for index, (run, job) in enumerate(zip(listed, jobs, strict=True))
    ]
    return sorted_runs(listed, finished)


def compare_plan(
    plan: Plan,
    backends: str,
    manager: CrosstrainPluginManager,
    launch: LaunchOptions = LaunchOptions(),
    seeds: int = 0,
    tolerance: float = 1e-4,
) -> tuple[ComparedRuns, Path]:
    """``crosstrain compare PLAN``: the comma-separated ``backends`` (and the seeds) run
    into ``launch.out`` (default: a new folder under runs/); the runs and the compare folder."""
    out_root = Path(launch.out) if launch.out else default_out_dir(plan, "compare", launch.replicas or 1)
    names = [name.strip() for name in backends.split(",") if name.strip()]
    return run_backends(plan, names, manager, out_root, launch, seeds, tolerance), out_root
