"""How `crosstrain compare` judges runs (no framework): the agreement horizon, the verdicts on
synthetic loss curves, the seed spread, and compare on finished runs through the CLI with the
momentum backend (a numpy model, in pytest's process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import numpy as np
import pytest

from crosstrain.compare.difference import BackendRun, compare_pair
from crosstrain.compare.folders import plan_difference, read_compare_file, read_step_losses
from crosstrain.compare.spread import MetricSpread, seed_spreads
from crosstrain.compare.verdict import FP64_FACTOR, FP64_FLOOR, Verdict, early_bound, judge
from tests.conftest import EXAMPLES, InProcessCli, run_cli

REFERENCE = 2.3 * np.exp(-np.arange(100) / 40)  # a falling loss curve of 100 steps


def _run(
    losses: np.ndarray | list[float],
    eval_loss: float = 0.5,
    accuracy: float = 0.9,
    backend: str = "tf",
    seed: int = 0,
) -> BackendRun:
    summary = {"eval": {"loss": eval_loss, "accuracy": accuracy, "count": 400.0}, "precision": "fp32"}
    losses = np.asarray(losses, dtype=np.float64)
    return BackendRun(backend, summary, losses, seed, probe=CORRECT_FP64)


#: a correct backend's first steps in fp64: the reference's exact losses, to fp64's rounding
#: (each run's fp32 losses lie off them by its own rounding)
CORRECT_FP64 = REFERENCE[:2] * (1 + 1e-15)


def _drifting(horizon: int, start: float = 1e-7, per_decade: float = 2.0) -> np.ndarray:
    """The reference's curve with a relative difference of ``start`` up to step ``horizon``,
    then growing by ``per_decade`` orders of magnitude per decade of steps."""
    steps = np.arange(1, len(REFERENCE) + 1)
    relative = np.where(steps <= horizon, start, 2e-4 * (steps / (horizon + 1)) ** per_decade)
    return REFERENCE * (1 + relative)


def _seeds(eval_losses: list[float], accuracies: list[float]) -> list[BackendRun]:
    """Seed runs of the reference backend (seeds 1, 2, ...): their curves differ from the start."""
    return [
        _run(REFERENCE * 1.1, loss, accuracy, "torch", seed)
        for seed, (loss, accuracy) in enumerate(zip(eval_losses, accuracies, strict=True), 1)
    ]


def _verdict(candidate: BackendRun, seed_runs: list[BackendRun]) -> Verdict:
    reference = _run(REFERENCE, backend="torch")
    comparison = compare_pair(reference, candidate, tolerance=1e-4)
    spreads = seed_spreads(reference, seed_runs)
    seeds = [reference.seed, *(run.seed for run in seed_runs)]
    return judge([comparison], spreads, seeds, accuracy_tolerance=0.01)


# --------------------------------------------------------------------------- the horizon


def test_the_horizon_is_the_last_step_within_tolerance_and_the_growth_is_sampled_after_it() -> None:
    comparison = compare_pair(_run(REFERENCE, backend="torch"), _run(_drifting(20)), tolerance=1e-4)
    assert (comparison.horizon, comparison.leaves_at) == (20, 21)
    growth = comparison.growth()
    assert [step for step, _ in growth] == [21, 35, 59, 100]  # log-spaced from the first step out
    assert growth[0][1] == pytest.approx(2e-4, rel=1e-6)
    assert growth[-1][1] == pytest.approx(2e-4 * (100 / 21) ** 2, rel=1e-6)  # two decades per decade
    assert comparison.early_difference()[1] == pytest.approx(1e-7, rel=1e-6)
    assert comparison.worst_step == 100


def test_a_curve_that_never_leaves_has_the_whole_run_as_horizon() -> None:
    comparison = compare_pair(_run(REFERENCE, backend="torch"), _run(REFERENCE * (1 + 3e-5)), 1e-4)
    assert (comparison.horizon, comparison.leaves_at, comparison.growth()) == (100, None, [])


def test_a_nan_step_is_beyond_any_tolerance() -> None:
    losses = REFERENCE.copy()
    losses[4] = np.nan
    comparison = compare_pair(_run(REFERENCE, backend="torch"), _run(losses), tolerance=1.0)
    assert (comparison.horizon, comparison.leaves_at) == (4, 5)


def test_a_folder_reused_by_a_second_run_yields_the_last_run_only(tmp_path: Path) -> None:
    first = [{"step": s, "epoch": 0, "lr": 0.1, "loss": 9.0} for s in (1, 2, 3)]
    second = [{"step": s, "epoch": 0, "lr": 0.1, "loss": float(s)} for s in (1, 2)]
    evaluation = [{"step": 2, "epoch": 0, "eval": {"loss": 0.5}}]
    lines = [json.dumps(record) for record in first + second + evaluation]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert read_step_losses(tmp_path).tolist() == [1.0, 2.0]


# --------------------------------------------------------------------------- the verdicts


def test_agree_within_tolerance_at_every_step_and_at_the_end() -> None:
    verdict = _verdict(_run(REFERENCE * (1 + 2e-7)), [])
    assert verdict.kind == "AGREE" and verdict.exit_code == 0
    assert verdict.line.startswith("verdict: AGREE: every step's loss within 0.0001 (relative) for all 100")


def test_an_eval_accuracy_gap_alone_is_no_agreement() -> None:
    verdict = _verdict(_run(REFERENCE, accuracy=0.95), [])
    assert verdict.kind == "DRIFTED"
    assert "every step within 0.0001, but tf's eval loss differs by 0.0e+00, its eval accuracy by 0.0500" in (
        verdict.line
    )


def test_a_drift_without_seed_runs_is_drifted_and_says_how_to_judge_it() -> None:
    verdict = _verdict(_run(_drifting(20), eval_loss=0.52, accuracy=0.92), [])
    assert verdict.kind == "DRIFTED" and verdict.exit_code == 0
    assert verdict.line == (
        "verdict: DRIFTED after step 20 (tf leaves 0.0001 at step 21, 4.5e-03 by step 100); no seed "
        "spread to judge it by: --seeds 3 tells EQUIVALENT from DIFFERENT"
    )


def test_a_drift_within_the_seed_spread_is_equivalent_with_the_numbers() -> None:
    seeds = _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86])
    verdict = _verdict(_run(_drifting(20), eval_loss=0.52, accuracy=0.92), seeds)
    assert verdict.kind == "EQUIVALENT" and verdict.exit_code == 0
    assert verdict.line.startswith("verdict: EQUIVALENT: every step within 0.0001 up to step 20 (tf leaves")
    assert (
        "tf's eval accuracy 0.9200 differs from torch's 0.9000 by 0.0200; seeds 0..3 spread "
        "0.8600..0.9300 (0.0700), another seed lands in " in verdict.line
    )


def test_a_final_metric_outside_the_seed_spread_is_different() -> None:
    seeds = _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86])
    verdict = _verdict(_run(_drifting(20), eval_loss=0.52, accuracy=0.40), seeds)
    assert verdict.kind == "DIFFERENT" and verdict.exit_code == 1
    assert verdict.line.startswith("verdict: DIFFERENT (likely a bug): tf's eval accuracy 0.4000 differs")
    assert "outside where another seed lands" in verdict.line
    assert "eval loss" not in verdict.line  # the loss lies within: only what is outside is named


def test_a_difference_beyond_rounding_in_the_first_steps_is_different_even_within_the_spread() -> None:
    """A learning rate 10 % off shows at step 2 at ~1e-3, in fp32 and in fp64 alike, where
    two correct backends' fp64 losses agree to ~1e-15."""
    losses = _drifting(20)
    losses[1] = REFERENCE[1] * (1 + 1e-3)
    buggy = attrs.evolve(_run(losses, eval_loss=0.52, accuracy=0.92), probe=losses[:2].copy())
    seeds = _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86])
    for seed_runs in (seeds, []):  # no seeds needed to see it
        verdict = _verdict(buggy, seed_runs)
        assert verdict.kind == "DIFFERENT" and verdict.exit_code == 1
        assert verdict.line == (
            "verdict: DIFFERENT (likely a bug): tf's step-2 loss in fp64 differs from torch's by "
            "1.0e-03 (relative), beyond what rounding and fp32 constants explain (6.0e-08) so soon "
            "after the start"
        )


def test_rounding_the_model_amplifies_is_no_bug_however_large_in_fp32() -> None:
    """One framework's batch norm may round 1e3 times more than another's: tf's fp32 losses
    1.1e-4 off torch's at step 2, as far as a 5 % learning-rate bug takes them; in fp64 the
    correct run agrees to 1e-15 and the bug differs by 1.8e-4 still. The bound grows with
    the model's rounding only where that, scaled to fp64, passes the floor."""
    losses = _drifting(20)
    losses[1] = REFERENCE[1] * (1 + 1.1e-4)
    correct = _run(losses, eval_loss=0.52, accuracy=0.92)
    spreads = seed_spreads(_run(REFERENCE, backend="torch"), _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86]))
    comparison = compare_pair(_run(REFERENCE, backend="torch"), correct, tolerance=1e-4)
    assert comparison.early_difference()[1] == pytest.approx(1.1e-4)
    assert judge([comparison], spreads, [0, 1, 2, 3], 0.01).kind == "EQUIVALENT"
    assert early_bound(comparison) == FP64_FLOOR  # the model's rounding scaled to fp64 is less
    amplifying = attrs.evolve(correct, losses=losses * (1 + 1e-2))  # rounding 1e-2 from fp64
    bound = early_bound(compare_pair(_run(REFERENCE, backend="torch"), amplifying, tolerance=1e-4))
    assert bound == pytest.approx(FP64_FACTOR * 1e-2 * 2.0**-29, rel=2e-2)
    bug = attrs.evolve(correct, probe=REFERENCE[:2] * np.array([1, 1 + 1.8e-4]))
    buggy = compare_pair(_run(REFERENCE, backend="torch"), bug, tolerance=1e-4)
    assert judge([buggy], spreads, [0, 1, 2, 3], 0.01).kind == "DIFFERENT"
    # a model that rounds at fp32's unit roundoff or less is held to the floor
    exact = compare_pair(_run(REFERENCE, backend="torch"), _run(REFERENCE), tolerance=1e-4)
    assert early_bound(exact) == FP64_FLOOR


def test_without_a_fp64_probe_the_first_steps_are_not_judged_and_the_line_says_so() -> None:
    losses = _drifting(20)
    losses[1] = REFERENCE[1] * (1 + 1e-3)
    reference = _run(REFERENCE, backend="torch")
    candidate = attrs.evolve(_run(losses, eval_loss=0.52, accuracy=0.92), probe=None)
    comparison = compare_pair(reference, candidate, tolerance=1e-4)
    spreads = seed_spreads(reference, _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86]))
    verdict = judge([comparison], spreads, [0, 1, 2, 3], 0.01)
    assert verdict.kind == "EQUIVALENT"
    assert verdict.line.endswith(
        "; steps 1-2 not judged: no fp64 probe of tf (crosstrain compare PLAN runs them)"
    )


def test_in_bf16_the_fp64_probes_judge_the_first_steps_too() -> None:
    """bf16 rounds as much as a bug shows (4e-4 to 7e-4 in steps 1-2): its own losses cannot
    tell them apart, its fp64 probes can."""
    losses = _drifting(0, per_decade=1.0)
    bf16 = {"eval": {"loss": 0.52, "accuracy": 0.92, "count": 400.0}, "precision": "bf16"}
    reference = attrs.evolve(_run(REFERENCE, backend="torch"), summary={**bf16, "eval": {"loss": 0.5}})
    candidate = attrs.evolve(_run(losses), summary=bf16)
    drifted = judge([compare_pair(reference, candidate, 1e-4)], [], [0], 0.01)
    assert drifted.kind == "DRIFTED"
    assert drifted.line.startswith("verdict: DRIFTED from step 1 (tf leaves 0.0001 at step 1, ")
    assert "not judged" not in drifted.line
    buggy = attrs.evolve(candidate, probe=REFERENCE[:2] * 1.01)
    assert judge([compare_pair(reference, buggy, 1e-4)], [], [0], 0.01).kind == "DIFFERENT"


def test_different_step_counts_are_different() -> None:
    verdict = _verdict(_run(REFERENCE[:90]), _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86]))
    assert verdict.line == "verdict: DIFFERENT (likely a bug): tf ran 90 steps, torch 100"


def test_the_verdict_is_the_worst_candidates_and_the_horizon_the_earliest() -> None:
    reference = _run(REFERENCE, backend="torch")
    early, late = _run(_drifting(10), 0.52, 0.92, "tf"), _run(_drifting(30), 0.5, 0.9, "jax")
    comparisons = [compare_pair(reference, run, 1e-4) for run in (early, late)]
    seeds = _seeds([0.55, 0.47, 0.60], [0.88, 0.93, 0.86])
    verdict = judge(comparisons, seed_spreads(reference, seeds), [0, 1, 2, 3], 0.01)
    assert verdict.kind == "EQUIVALENT" and dict(verdict.per_candidate) == {
        "tf": "EQUIVALENT",
        "jax": "EQUIVALENT",
    }
    assert "up to step 10 (tf leaves 0.0001 at step 11" in verdict.line
    bad = _run(_drifting(30), 0.5, 0.2, "jax")
    comparisons[1] = compare_pair(reference, bad, 1e-4)
    verdict = judge(comparisons, seed_spreads(reference, seeds), [0, 1, 2, 3], 0.01)
    assert verdict.kind == "DIFFERENT" and dict(verdict.per_candidate) == {
        "tf": "EQUIVALENT",
        "jax": "DIFFERENT",
    }


# --------------------------------------------------------------------------- the seed spread


def test_the_spread_is_a_99_percent_prediction_interval_of_one_more_seed() -> None:
    spread = MetricSpread("eval score", "eval", "score", (1.0, 2.0, 3.0, 4.0))
    t_3_995 = 5.840909  # Student's t, 3 degrees of freedom, 0.995 quantile (a printed table's)
    half = t_3_995 * np.std([1, 2, 3, 4], ddof=1) * np.sqrt(1 + 1 / 4)
    assert spread.interval() == pytest.approx((2.5 - half, 2.5 + half), rel=1e-6)
    assert (spread.low, spread.high, spread.spread) == (1.0, 4.0, 3.0)
    assert spread.holds(2.5 + half * 0.99) and not spread.holds(2.5 + half * 1.01)


def test_the_interval_is_cut_to_the_values_a_metric_can_take() -> None:
    loss = MetricSpread("eval loss", "eval", "loss", (0.1, 0.2, 0.3, 0.4))
    accuracy = MetricSpread("eval accuracy", "eval", "accuracy", (0.6, 0.7, 0.8, 0.9))
    assert loss.interval()[0] == 0.0 and loss.interval()[1] > 0.4
    assert accuracy.interval()[1] == 1.0 and accuracy.interval()[0] < 0.6


def test_an_accuracy_resolves_one_eval_example_even_where_every_seed_lands_alike() -> None:
    reference = _run(REFERENCE, accuracy=1.0, backend="torch")
    (loss_spread, accuracy_spread) = seed_spreads(reference, _seeds([0.5, 0.5, 0.5], [1.0, 1.0, 1.0]))
    assert accuracy_spread.resolution == 1 / 400
    assert accuracy_spread.holds(1 - 1 / 400) and not accuracy_spread.holds(1 - 2 / 400)
    assert loss_spread.interval() == (0.5, 0.5)


def test_without_an_eval_set_the_final_train_loss_is_judged() -> None:
    def no_eval(run: BackendRun, train_loss: float) -> BackendRun:
        return attrs.evolve(run, summary={"train": {"loss": train_loss}, "precision": "fp32"})

    reference = no_eval(_run(REFERENCE, backend="torch"), 0.30)
    seeds = [
        no_eval(run, loss) for run, loss in zip(_seeds([0.5] * 3, [0.9] * 3), [0.32, 0.27, 0.35], strict=True)
    ]
    (spread,) = seed_spreads(reference, seeds)
    assert (spread.label, spread.values) == ("final train loss", (0.30, 0.32, 0.27, 0.35))
    comparison = compare_pair(reference, no_eval(_run(_drifting(20)), 0.31), 1e-4)
    verdict = judge([comparison], [spread], [0, 1, 2, 3], 0.01)
    assert verdict.kind == "EQUIVALENT"
    assert "tf's final train loss 0.3100 differs from torch's 0.3000 by 0.0100" in verdict.line


# --------------------------------------------------------------------------- the files


def test_plan_difference_names_the_first_differing_field() -> None:
    reference = {"model": {"layers": [{"units": 32}, {"rate": 0.5}]}, "optimizer": {"lr": 0.003}}
    other = {"model": {"layers": [{"units": 32}, {"rate": 0.25}]}, "optimizer": {"lr": 0.5}}
    assert plan_difference(reference, other) == ("model.layers[1].rate", 0.5, 0.25)
    assert plan_difference(reference, reference) is None
    assert plan_difference({"a": [1]}, {"a": [1, 2]}) == ("a", [1], [1, 2])


def test_an_older_compare_file_without_roles_reads_as_reference_and_candidates(tmp_path: Path) -> None:
    runs = [{"backend": "torch", "folder": "torch"}, {"backend": "tf", "folder": "tf"}]
    (tmp_path / "compare.json").write_text(json.dumps({"plan": "p", "runs": runs}))
    assert [(run.folder, run.role) for run in read_compare_file(tmp_path) or []] == [
        ("torch", "reference"),
        ("tf", "candidate"),
    ]
    runs[1]["role"] = "judge"
    (tmp_path / "compare.json").write_text(json.dumps({"plan": "p", "runs": runs}))
    with pytest.raises(
        Exception, match=re.escape("runs[1].role 'judge' is none of reference, candidate, seed, fp64")
    ):
        read_compare_file(tmp_path)


# --------------------------------------------------------------------------- through the CLI

PLAN = str(EXAMPLES / "digits_mlp.toml")
MOMENTUM = ("-p", "crosstrain.testing.null", "-p", "no:progress")


@pytest.fixture
def momentum_compare(tmp_path: Path, cli_in_process: InProcessCli) -> Path:
    """momentum against itself (agrees bit for bit) with two seed runs, six steps each."""
    out = tmp_path / "cmp"
    result = cli_in_process(
        *MOMENTUM, "compare", PLAN, "--backends", "momentum,momentum", "--seeds", "2",
        "--set", "train.max_steps=6", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("verdict: AGREE")
    (out / "verdict.txt").write_text(result.stdout.strip().splitlines()[-1])
    return out


def test_seed_runs_are_listed_with_their_roles_and_judged_again_from_the_folder(
    momentum_compare: Path, cli_in_process: InProcessCli
) -> None:
    listed = json.loads((momentum_compare / "compare.json").read_text())
    assert listed["tolerance"] == 1e-4
    compared = [(run["folder"], run["role"], run["seed"]) for run in listed["runs"] if run["role"] != "fp64"]
    assert compared == [
        ("momentum-0", "reference", 0),
        ("momentum-1", "candidate", 0),
        ("momentum-seed1", "seed", 1),
        ("momentum-seed2", "seed", 2),
    ]
    assert [(run["folder"], run["probes"]) for run in listed["runs"] if run["role"] == "fp64"] == [
        ("momentum-0-fp64", "momentum-0"),
        ("momentum-1-fp64", "momentum-1"),
    ]
    probe = json.loads((momentum_compare / "momentum-0-fp64" / "plan.json").read_text())["plan"]["train"]
    assert (probe["precision"], probe["max_steps"]) == ("fp64", 2)
    image = momentum_compare.parent / "compare.png"
    again = cli_in_process(*MOMENTUM, "compare", str(momentum_compare), "--plot", str(image))
    assert again.returncode == 0, again.stderr
    *_, verdict, wrote = again.stdout.strip().splitlines()
    assert verdict == (momentum_compare / "verdict.txt").read_text()
    assert wrote == f"wrote {image}" and image.read_bytes()[:4] == b"\x89PNG"
    assert "momentum-0 seeds 0..2" in again.stdout  # the spread column


def test_runs_of_another_plan_are_refused_naming_the_field(
    momentum_compare: Path, tmp_path: Path, cli_in_process: InProcessCli
) -> None:
    other = tmp_path / "other"
    made = cli_in_process(
        *MOMENTUM, "run", PLAN, "--backend", "momentum", "--set", "train.max_steps=6",
        "--set", "optimizer.lr=0.5", "--out", str(other),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = cli_in_process(*MOMENTUM, "compare", str(momentum_compare), str(other))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"crosstrain: error: {other}: its plan differs from {momentum_compare / 'momentum-0'}'s in "
        "optimizer.lr (0.5 there, 0.003 in the reference): compare takes runs of one plan, seeds aside"
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seeds", "3"], "--seeds: says how to run a plan; {cmp} holds runs trained already"),
        (["--backends", "torch,tf"], "--backends: says how to run a plan; {cmp} holds runs trained already"),
        (["--nproc", "2"], "--nproc: says how to run a plan; {cmp} holds runs trained already"),
        (["--timeout", "5"], "--timeout: says how to run a plan; {cmp} holds runs trained already"),
        ([PLAN], f"{PLAN}: holds neither plan.json (a run folder) nor compare.json (a compare folder)"),
    ],
)
def test_plan_options_with_run_folders_are_refused(
    momentum_compare: Path, cli_in_process: InProcessCli, extra: list[str], message: str
) -> None:
    result = cli_in_process(*MOMENTUM, "compare", str(momentum_compare), *extra)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert message.format(cmp=momentum_compare) in result.stderr


def test_plan_options_at_their_defaults_are_no_plan_options(
    momentum_compare: Path, cli_in_process: InProcessCli
) -> None:
    """A flag given at its default value says nothing new: the finished runs are judged."""
    result = cli_in_process(
        *MOMENTUM, "compare", str(momentum_compare), "--device", "auto", "--timeout", "300"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (momentum_compare / "verdict.txt").read_text().strip()


def test_a_seed_run_alone_is_no_comparison(momentum_compare: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process(
        *MOMENTUM, "compare", str(momentum_compare / "momentum-0"), str(momentum_compare / "momentum-seed1")
    )
    assert result.returncode == 2
    assert "compare needs a run of" in result.stderr and "seed runs" in result.stderr


def test_compare_without_the_metrics_plugin_says_why_not_in_one_line(tmp_path: Path) -> None:
    plan = str(EXAMPLES / "digits_mlp.toml")
    result = run_cli(
        "-p", "no:metrics", "compare", plan, "--backends", "torch,tf", "--out", str(tmp_path / "c")
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "crosstrain: error: compare reads each run's per-step losses from metrics.jsonl, which the "
        "'metrics' plugin writes: drop -p no:metrics"
    ]
    assert not (tmp_path / "c").exists()  # refused before anything is written


def test_a_folder_that_holds_no_run_is_named(tmp_path: Path, cli_in_process: InProcessCli) -> None:
    result = cli_in_process("compare", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"crosstrain: error: {tmp_path}: holds neither plan.json (a run folder) nor compare.json "
        "(a compare folder)"
    ]


def test_runs_in_fp64_are_their_own_probes_judged_by_the_floor() -> None:
    fp64 = {"eval": {"loss": 0.5, "accuracy": 0.9, "count": 400.0}, "precision": "fp64"}
    reference = BackendRun("torch", fp64, REFERENCE.copy())
    correct = BackendRun("tf", fp64, REFERENCE * (1 + 1e-14))
    comparison = compare_pair(reference, correct, 1e-4)
    assert early_bound(comparison) == FP64_FLOOR
    assert judge([comparison], [], [0], 0.01).kind == "AGREE"
    buggy = REFERENCE.copy()
    buggy[1] *= 1 + 1e-3
    verdict = judge([compare_pair(reference, BackendRun("tf", fp64, buggy), 1e-4)], [], [0], 0.01)
    assert verdict.kind == "DIFFERENT" and "step-2 loss in fp64 differs" in verdict.line
