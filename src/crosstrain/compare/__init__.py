"""`crosstrain compare`: one plan on several backends, per-step losses side by side, and a verdict.

Each backend runs into its own subfolder of the compare folder, and ``--seeds K`` runs the
reference backend (the first) K more times with seeds seed+1..seed+K; ``compare.json``
there lists every run with its role (the reference first), so ``crosstrain plot COMPARE_DIR``
draws them all and ``crosstrain compare COMPARE_DIR`` (or its run folders) judges them
again without training.

One concern a module, each importing only those above it in this list:

- :mod:`~crosstrain.compare.difference`: a candidate's per-step loss difference from the
  reference's, the agreement horizon;
- :mod:`~crosstrain.compare.spread`: the seed spread, where a further seed would land;
- :mod:`~crosstrain.compare.verdict`: AGREE, EQUIVALENT, DRIFTED or DIFFERENT, and why
  (docs/running.md#compare-agreement-horizon-and-seed-spread);
- :mod:`~crosstrain.compare.folders`: ``compare.json``, roles, reading finished run folders;
- :mod:`~crosstrain.compare.launch`: running the plan on each backend and the seed runs;
- :mod:`~crosstrain.compare.table`: the side-by-side table and the verdict line.

The names below are re-exported for users; crosstrain's own modules import each from the
module that holds it.
"""

from crosstrain.compare.difference import BackendRun, ComparedRuns, Comparison, compare_pair
from crosstrain.compare.folders import (
    COMPARE_FILE,
    ListedRun,
    Role,
    compare_file_tolerance,
    compare_roles,
    is_run_or_compare_folder,
    load_run_folders,
    not_a_run_folder,
    plan_difference,
    read_backend_run,
    read_compare_file,
    read_step_losses,
    write_compare_file,
)
from crosstrain.compare.launch import compare_plan, plan_runs, run_backends
from crosstrain.compare.spread import MetricSpread, seed_spreads
from crosstrain.compare.table import print_comparison
from crosstrain.compare.verdict import FP64_FACTOR, Kind, Verdict, judge

__all__ = [
    "COMPARE_FILE",
    "FP64_FACTOR",
    "BackendRun",
    "ComparedRuns",
    "Comparison",
    "Kind",
    "ListedRun",
    "MetricSpread",
    "Role",
    "Verdict",
    "compare_file_tolerance",
    "compare_pair",
    "compare_plan",
    "compare_roles",
    "is_run_or_compare_folder",
    "judge",
    "load_run_folders",
    "not_a_run_folder",
    "plan_difference",
    "plan_runs",
    "print_comparison",
    "read_backend_run",
    "read_compare_file",
    "read_step_losses",
    "run_backends",
    "seed_spreads",
    "write_compare_file",
]
