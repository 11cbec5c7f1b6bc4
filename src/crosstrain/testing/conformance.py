"""The conformance suite every backend runs: crosstrain's own and a third party's.

Subclass :class:`BackendConformance` in a test module, name the backend, and pytest runs
every check on it (Keras 3 runs its one suite once per backend the same way)::

    from crosstrain.testing.conformance import BackendConformance

    class TestMineConformance(BackendConformance):
        backend = "mine"

Each check runs the real ``crosstrain`` CLI in subprocesses, on small plans of every kind
(:mod:`crosstrain.testing.plans`, and the model zoo's ResNet-50, MobileNetV2, U-Net, ViT-B/16,
GPT-2 and Llama scaled down: :mod:`crosstrain.testing.zoo`): world N trains like world 1 (batch norm, dropout,
per-token loss), eval counts every row once, data placed on the device trains bit for bit
as data gathered on the host, a compiled step and accumulated micro-batches train like
the plain step, fp64 trains like fp32 in float64, the README's digits example reaches
95 %, the backend agrees step by step with the torch reference (when torch is
installed), a failing rank ends the run naming it
(the whole fault matrix: :mod:`crosstrain.testing.fault_matrix`), a run resumed from its
last checkpoint after a failure (by ``--resume`` from the run folder alone, or by the
launcher under ``--max-restarts``) takes exactly the uninterrupted run's steps and writes
its checkpoints, a new run from a finished run's weights (``--init-from``, also torch's)
evaluates them at step 0 as the source run did at its end, a non-finite loss stops
the run at its step (or is skipped), a plan the backend cannot build is refused before
launch, and a finished run evaluates and predicts in one process to the metrics training
measured.

Beside it: :class:`crosstrain.testing.agreement.AgreesWithTorch` (step by step against the
torch reference), :class:`crosstrain.testing.fault_matrix.FaultConformance` (ranks killed and
hung) and :class:`crosstrain.testing.feed_conformance.FeedConformance` (the feed, in process,
against core's rows protocol); the checks they share are :mod:`crosstrain.testing.run_checks`.

Every run a check compares with is made once per pytest session
(:class:`crosstrain.testing.launches.RunCache`, keyed by backend, plan, world, settings and
flags): the world-N run of the dropout MLP
serves the world, placement, compile, accumulation, resume and restart checks, and, in a
session that also tests agreement, the comparison with torch, whose own reference runs
serve every backend compared with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from crosstrain.core.data.batches import GlobalSampler
from crosstrain.core.errors import PlanError
from crosstrain.core.run.checkpoint import complete_checkpoints, load_checkpoint
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.strategy import PlacesData, Predicts, SkipsNonFiniteSteps
from crosstrain.core.spec.plan import SHARD_MODES
from crosstrain.core.spec.planfile import load_plan
from crosstrain.core.spec.vocabulary import (
    CORE_VOCABULARY,
    SpeaksVocabulary,
    check_shard_mode,
    missing_names,
)
from crosstrain.plugins.manager import get_backend, make_plugin_manager
from crosstrain.testing.data_plans import NAN_ROW_PLAN, write_nan_row_data
from crosstrain.testing.launches import (
    PLAN_SETTINGS,
    PLANS,
    STEPS,
    RunCache,
    SharesRuns,
    run_cli,
    train,
    train_refused,
    write_plan,
)
from crosstrain.testing.run_checks import (
    CHECKPOINT_EVERY,
    FAIL_STEP,
    RESUME_SETTINGS,
    WORLD_TOLERANCE,
    fail_then_resume,
    spoken_plans,
    start_from,
)
from crosstrain.testing.runs import assert_same_eval, max_relative_difference, step_losses, summary

#: sharded against unsharded at the same world (fp32): the same arithmetic reduced in other
#: pieces at most (FSDP2's reduce-scatter against DDP's all-reduce: the same bits measured)
SHARD_TOLERANCE = 1e-6
#: what each shard mode divides among the replicas (summary.json's ``memory_per_rank`` parts)
SHARDED_PARTS = {"optimizer": ("optimizer",), "full": ("parameters", "gradients", "optimizer")}
#: a sharded rank's share above 1/N: a dimension that does not divide by N splits unevenly
SHARE_SLACK = 0.05
#: the plans trained with their data placed on the device (``data.placement = "device"``):
#: arrays, token windows, and uint8 rows of a memory-mapped file scaled where the model runs
PLACED_PLANS = ("dropout_mlp", "gpt2_small", "scaled_images")


class WorldRuns:
    """Each plan the backend speaks, at world 1 and world N, from the session's runs."""

    def __init__(self, backend: str, nproc: int, runs: RunCache) -> None:
        self.backend, self.nproc, self.runs = backend, nproc, runs
        self.spoken = spoken_plans(backend, runs.factory.mktemp("plans"))

    def __contains__(self, name: str) -> bool:
        return name in self.spoken

    def __getitem__(self, name: str) -> tuple[Path, Path]:
        return self.runs(self.backend, name, 1), self.runs(self.backend, name, self.nproc)


class BackendConformance(SharesRuns):
    """What every backend must satisfy; ``backend`` names the one under test."""

    backend: ClassVar[str]
    #: replicas for the world-N runs
    nproc: ClassVar[int] = 2

    @pytest.fixture
    def world_runs(self, runs: RunCache) -> WorldRuns:
        """Every plan the backend speaks, at world 1 and world N, each trained once per session."""
        return WorldRuns(self.backend, self.nproc, runs)

    @pytest.mark.parametrize("plan", list(PLANS))
    def test_world_n_trains_like_world_1(self, world_runs: WorldRuns, plan: str) -> None:
        if plan not in world_runs:
            pytest.skip(f"the {self.backend} backend does not speak this plan's layers")
        one, many = world_runs[plan]
        assert len(step_losses(one)) == STEPS
        assert max_relative_difference(step_losses(many), step_losses(one)) <= WORLD_TOLERANCE
        # eval counts every real row once (the digits' 359 eval rows are not a multiple of
        # the batch); batch norm's running statistics are the same at both worlds
        assert_same_eval(summary(many)["eval"], summary(one)["eval"], loss_tolerance=WORLD_TOLERANCE, flips=1)
        assert summary(many)["world_size"] == self.nproc
        ranks = summary(many)["ranks"]  # one report per process: time split, peak memory
        assert [report["rank"] for report in ranks] == list(range(summary(many)["processes"]))
        assert all(
            report["step_seconds"] > 0 and report["cpu_seconds"] > 0 and report["peak_host_memory_bytes"] > 0
            for report in ranks
        )

    def test_placing_the_data_changes_no_loss(self, world_runs: WorldRuns, tmp_path: Path) -> None:
        """``data.placement = "device"`` (rows gathered by index where the model runs, inputs
        scaled there) gives the host's per-step losses and eval bit for bit, at world N. The
        host side is the world-N run above: "auto" on a CPU keeps the data on the host (each
        backend's own feed tests check that), so world 1 agrees with placed world N too.
        A backend without :class:`PlacesData` refuses the placement before launch."""
        strategy = get_backend(make_plugin_manager(), self.backend)()
        if not isinstance(strategy, PlacesData):
            plan = write_plan(tmp_path, "dropout_mlp")
            refused = train_refused(self.backend, plan, tmp_path / "refused", "data.placement='device'")
            assert "data.placement = 'device': the" in refused
            pytest.skip(f"the {self.backend} backend keeps the data on the host (no PlacesData)")
        placed_plans = [name for name in PLACED_PLANS if name in world_runs]
        assert placed_plans, f"the {self.backend} backend speaks none of {PLACED_PLANS}"
        for name in placed_plans:
            hosted = world_runs[name][1]
            placed = world_runs.runs(self.backend, name, self.nproc, "data.placement='device'")
            assert np.array_equal(step_losses(placed), step_losses(hosted)), name  # the same bits
            assert summary(placed)["eval"] == summary(hosted)["eval"], name

    def test_a_compiled_step_trains_like_eager(self, world_runs: WorldRuns) -> None:
        """``train.compile`` (torch.compile, XLA, a third party's compiler) changes how the
        step runs, not what it computes: dropout masks, loss and updates within rounding."""
        self._trains_like_the_plain_step(world_runs, "train.compile=true")

    def test_accumulated_micro_batches_train_like_one_big_batch(self, world_runs: WorldRuns) -> None:
        """``train.grad_accum_steps = 2``: each replica's share of a global batch in two
        micro-batches, one update: the per-step losses of one big batch, within rounding."""
        self._trains_like_the_plain_step(world_runs, "train.grad_accum_steps=2")

    def test_fp64_trains_like_fp32_in_float64(self, world_runs: WorldRuns, tmp_path: Path) -> None:
        """``train.precision = "fp64"``: every value of the step in float64, from the same
        initial weights: fp32's losses within fp32's rounding, and the weights saved as
        float64 (core's ``WEIGHT_DTYPES``). A backend without fp64 refuses it before launch."""
        strategy = get_backend(make_plugin_manager(), self.backend)()
        if isinstance(strategy, SpeaksVocabulary) and "fp64" not in strategy.vocabulary().precisions:
            plan = write_plan(tmp_path, "dropout_mlp")
            refused = train_refused(self.backend, plan, tmp_path / "refused", "train.precision='fp64'")
            assert "train.precision: the" in refused
            pytest.skip(f"the {self.backend} backend has no fp64")
        wide = self._trains_like_the_plain_step(world_runs, "train.precision='fp64'")
        weights = load_checkpoint(wide / "model.safetensors")
        assert {str(array.dtype) for array in weights.values()} == {"float64"}

    def _trains_like_the_plain_step(self, world_runs: WorldRuns, setting: str) -> Path:
        """The dropout MLP at world N with ``setting``: the plain run's steps and eval; that run."""
        if "dropout_mlp" not in world_runs:
            pytest.skip(f"the {self.backend} backend does not speak the dropout MLP")
        plain = world_runs["dropout_mlp"][1]
        varied = world_runs.runs(self.backend, "dropout_mlp", self.nproc, setting)
        assert max_relative_difference(step_losses(varied), step_losses(plain)) <= WORLD_TOLERANCE
        assert_same_eval(summary(varied)["eval"], summary(plain)["eval"], loss_tolerance=WORLD_TOLERANCE)
        return varied

    @pytest.mark.parametrize("mode", [mode for mode in SHARD_MODES if mode != "none"])
    def test_a_sharded_run_trains_like_the_unsharded_one(
        self, world_runs: WorldRuns, mode: str, tmp_path: Path
    ) -> None:
        """``train.shard`` changes what each replica holds, not what it computes: the world-N
        dropout MLP's steps and eval within SHARD_TOLERANCE of the unsharded run's, and the
        largest rank holding its share of the memory (``memory_per_rank``). A mode the backend
        does not declare is refused before launch, naming the field."""
        if self._refuses_shard_mode(mode, tmp_path):
            pytest.skip(f"the {self.backend} backend has no shard mode {mode!r}")
        plain = world_runs["dropout_mlp"][1]
        sharded = world_runs.runs(self.backend, "dropout_mlp", self.nproc, f"train.shard='{mode}'")
        assert max_relative_difference(step_losses(sharded), step_losses(plain)) <= SHARD_TOLERANCE
        assert_same_eval(summary(sharded)["eval"], summary(plain)["eval"], loss_tolerance=SHARD_TOLERANCE)
        replicated, held = summary(plain)["memory_per_rank"], summary(sharded)["memory_per_rank"]
        parts = SHARDED_PARTS[mode]
        share = sum(held[part] for part in parts) / sum(replicated[part] for part in parts)
        assert share <= 1 / self.nproc + SHARE_SLACK, (mode, held, replicated)

    @pytest.mark.parametrize("mode", [mode for mode in SHARD_MODES if mode != "none"])
    def test_a_sharded_run_resumes_exactly(self, world_runs: WorldRuns, mode: str, tmp_path: Path) -> None:
        """A sharded run killed at FAIL_STEP and resumed from its folder alone takes exactly
        the uninterrupted sharded run's steps: each rank's shards of the weights and of the
        optimizer's state come back from the neutral checkpoint."""
        if self._refuses_shard_mode(mode, tmp_path):
            pytest.skip(f"the {self.backend} backend has no shard mode {mode!r}")
        setting = f"train.shard='{mode}'"
        uninterrupted = world_runs.runs(self.backend, "dropout_mlp", self.nproc, setting)
        plan = write_plan(tmp_path, "dropout_mlp")
        resumed = fail_then_resume(self.backend, plan, tmp_path / "run", self.nproc, settings=(setting,))
        assert np.array_equal(step_losses(resumed), step_losses(uninterrupted))
        assert summary(resumed)["eval"] == summary(uninterrupted)["eval"]

    def _refuses_shard_mode(self, mode: str, directory: Path) -> bool:
        """Whether the backend lacks ``mode``; if so, that admission refuses it in one line
        naming ``train.shard`` (checked in this process: the refusal comes before launch)."""
        strategy = get_backend(make_plugin_manager(), self.backend)()
        vocabulary = strategy.vocabulary() if isinstance(strategy, SpeaksVocabulary) else None
        if vocabulary is not None and mode in vocabulary.shard:
            return False
        plan = load_plan(write_plan(directory / "refused", "dropout_mlp"), [f"train.shard='{mode}'"])
        with pytest.raises(PlanError, match=r"train\.shard") as refused:
            check_shard_mode(plan, vocabulary, self.backend)
        assert "\n" not in str(refused.value)
        return True

    def test_the_digits_example_reaches_95_percent(self, tmp_path: Path) -> None:
        """The README's example, whole (20 epochs), at world N: real accuracy, a summary that
        says what ran, the final weights saved, and the summary table printed. (Its own run:
        no other check reads it.)"""
        plan = write_plan(tmp_path, "digits_mlp")
        run = train(self.backend, plan, tmp_path / "run", self.nproc, steps=None)
        result = summary(run)
        assert result["eval"]["accuracy"] >= 0.95
        assert result["backend"] == self.backend and result["world_size"] == self.nproc
        assert all(result[key] > 0 for key in ("steps", "samples_per_second", "wall_seconds"))
        assert (run / "model.safetensors").is_file()
        printed = (run / "stdout.txt").read_text()
        assert f"digits_mlp on {self.backend} x{self.nproc}" in printed and "eval accuracy" in printed

    def test_resumes_exactly_from_its_last_checkpoint(self, world_runs: WorldRuns, tmp_path: Path) -> None:
        """Adam's step counts, dropout's counter and the sampler's place mid-epoch all come
        back: the resumed steps equal the uninterrupted run's bit for bit."""
        uninterrupted = world_runs["dropout_mlp"][1]
        resumed = fail_then_resume(
            self.backend, write_plan(tmp_path, "dropout_mlp"), tmp_path / "run", self.nproc
        )
        assert np.array_equal(step_losses(resumed), step_losses(uninterrupted))  # each step once
        assert summary(resumed)["eval"] == summary(uninterrupted)["eval"]
        assert summary(resumed)["train"] == summary(uninterrupted)["train"]

    def test_a_new_run_starts_from_a_finished_run_s_weights(
        self, world_runs: WorldRuns, tmp_path: Path
    ) -> None:
        """``--init-from RUN_DIR``: a new run from the run's final weights (optimizer fresh,
        step 0) evaluates them first: its step-0 evaluation is the source run's final one."""
        source = world_runs["dropout_mlp"][1]
        plan = write_plan(tmp_path, "dropout_mlp")
        started = start_from(self.backend, plan, source, tmp_path / "run", self.nproc)
        assert started == summary(source)["eval"]  # the same weights, layout and backend: the same bits

    def test_a_restarted_group_trains_like_an_uninterrupted_run(
        self, world_runs: dict[str, tuple[Path, Path]], tmp_path: Path
    ) -> None:
        """``--max-restarts 1``: a rank fails once at FAIL_STEP; the backend's launcher stops
        and restarts the whole group, which resumes from the last checkpoint and ends with
        exactly the uninterrupted run's steps."""
        uninterrupted = world_runs["dropout_mlp"][1]
        once = tmp_path / "failed-once"
        result = run_cli(
            "-p", "no:progress", "-p", "crosstrain.testing.faults", "run",
            str(write_plan(tmp_path, "dropout_mlp")), "--backend", self.backend, "--nproc", str(self.nproc),
            "--device", "cpu", "--out", str(tmp_path / "run"), "--set", f"train.max_steps={STEPS}",
            *RESUME_SETTINGS, "--max-restarts", "1",
            env={"CROSSTRAIN_TEST_FAIL_STEP": str(FAIL_STEP), "CROSSTRAIN_TEST_FAIL_ONCE": str(once)},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert once.exists()  # a rank did fail
        assert (
            summary(tmp_path / "run")["resumed_from_step"] == FAIL_STEP // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        )
        assert np.array_equal(step_losses(tmp_path / "run"), step_losses(uninterrupted))  # each step once
        assert summary(tmp_path / "run")["eval"] == summary(uninterrupted)["eval"]

    def test_a_non_finite_loss_stops_the_run_at_its_step(self, tmp_path: Path) -> None:
        """A corrupt row makes one step's loss non-finite: the run stops there with one line naming the
        step, exit 1, the checkpoints before it intact and no NaN model saved; with
        ``train.on_nonfinite = "skip"`` that step's update is skipped and training goes on."""
        write_nan_row_data(str(tmp_path / "nan_row.npz"), row=300)
        plan = tmp_path / "nan.toml"
        plan.write_text(NAN_ROW_PLAN)
        nan_step = next(
            step + 1 for step, (rows, _) in enumerate(GlobalSampler(1797, 32, seed=4).epoch(0)) if 300 in rows
        )
        common = (
            "-p",
            "no:progress",
            "run",
            str(plan),
            "--backend",
            self.backend,
            "--nproc",
            str(self.nproc),
        )
        stopped = run_cli(*common, "--device", "cpu", "--out", str(tmp_path / "stop"))
        assert stopped.returncode == 1, stopped.stderr
        last = stopped.stderr.strip().splitlines()[-1]
        assert (
            last.startswith("crosstrain: error: rank ")
            and "non-finite loss (" in last
            and f") at step {nan_step};" in last
        )
        records = [
            json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()
        ]
        assert records[-1]["step"] == nan_step and records[-1]["loss"] is None
        assert complete_checkpoints(tmp_path / "stop")[-1][0] == (nan_step - 1) // 5 * 5  # the last good one
        assert not (tmp_path / "stop" / "model.safetensors").exists()
        skip = ("--set", "train.on_nonfinite='skip'", "--device", "cpu", "--out", str(tmp_path / "skip"))
        skipped = run_cli(*common, *skip)
        strategy = get_backend(make_plugin_manager(), self.backend)()
        if not (isinstance(strategy, SkipsNonFiniteSteps) and strategy.skips_nonfinite_steps()):
            # a backend that cannot skip on the device says so before launch, in one line
            assert skipped.returncode == 2 and skipped.stderr.strip().count("\n") == 0, skipped.stderr
            assert "train.on_nonfinite = 'skip': the" in skipped.stderr
            assert not (tmp_path / "skip").exists()
            return
        assert skipped.returncode == 0, skipped.stderr
        assert summary(tmp_path / "skip")["skipped_nonfinite_steps"] == 1
        losses = step_losses(tmp_path / "skip")
        assert (
            np.isfinite(losses[nan_step:].astype(float)).all()
            and len(losses) == GlobalSampler(1797, 32, 4).steps_per_epoch
        )

    def test_predicts_what_it_evaluates(self, world_runs: WorldRuns, tmp_path: Path) -> None:
        """``crosstrain evaluate`` in one process gives training's own eval metrics, and
        ``crosstrain predict`` (the backend's ``predict``) gives logits whose loss and
        accuracy over the eval rows are those metrics."""
        strategy = get_backend(make_plugin_manager(), self.backend)()
        assert isinstance(strategy, Predicts), "implement predict() for crosstrain predict and export"
        plan = write_plan(tmp_path, "dropout_mlp")
        run = world_runs["dropout_mlp"][0]
        trained = summary(run)["eval"]
        evaluated = run_cli("evaluate", str(run), "--backend", self.backend, "--json")
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert_same_eval(json.loads(evaluated.stdout)["eval"], trained, loss_tolerance=WORLD_TOLERANCE)
        rows = load_datasets(load_plan(plan)).eval
        assert rows is not None
        np.save(tmp_path / "rows.npy", np.asarray(rows.x[np.arange(len(rows))]))
        out = tmp_path / "logits.npy"
        predicted = run_cli(
            "predict",
            str(run),
            "--backend",
            self.backend,
            "--data",
            str(tmp_path / "rows.npy"),
            "--out",
            str(out),
        )
        assert predicted.returncode == 0, predicted.stderr[-3000:]
        logits = np.load(out).astype(np.float64)
        labels = np.asarray(rows.y[np.arange(len(rows))])
        assert logits.shape == (len(rows), 10)
        shifted = logits - logits.max(axis=1, keepdims=True)
        losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(rows)), labels]
        from_logits = {
            "loss": float(losses.mean()),
            "accuracy": float((logits.argmax(axis=1) == labels).mean()),
            "count": float(len(rows)),
        }
        assert_same_eval(from_logits, trained, loss_tolerance=WORLD_TOLERANCE, flips=1)

    def test_declares_a_vocabulary_of_core_names(self) -> None:
        strategy = get_backend(make_plugin_manager(), self.backend)()
        assert isinstance(strategy, SpeaksVocabulary), (
            "declare vocabulary() so plans are checked before launch"
        )
        vocabulary = strategy.vocabulary()
        for kind in ("layers", "losses", "optimizers", "precisions"):
            unknown = getattr(vocabulary, kind) - getattr(CORE_VOCABULARY, kind)
            assert not unknown, f"{kind} that core does not define: {sorted(unknown)}"
        assert {"dense", "relu"} <= vocabulary.layers and "fp32" in vocabulary.precisions

    def test_refuses_what_it_cannot_build_before_launch(self, tmp_path: Path) -> None:
        strategy = get_backend(make_plugin_manager(), self.backend)()
        assert isinstance(strategy, SpeaksVocabulary)
        missing = missing_names(strategy.vocabulary())
        unspoken = [name for name in PLANS if name not in spoken_plans(self.backend, tmp_path / "check")]
        cases: list[tuple[Path, tuple[str, ...]]] = [
            (write_plan(tmp_path / name, name), PLAN_SETTINGS.get(name, ())) for name in unspoken
        ]
        mlp = write_plan(tmp_path / "mlp", "dropout_mlp")
        cases += [(mlp, (f"optimizer.name='{name}'",)) for name in missing.get("optimizers", [])[:1]]
        cases += [(mlp, (f"train.precision='{name}'",)) for name in missing.get("precisions", [])[:1]]
        assert bool(cases) == bool(missing)  # a complete backend has nothing to refuse
        for plan, settings in cases:
            out = tmp_path / "refused"
            arguments = [item for setting in settings for item in ("--set", setting)]
            result = run_cli("run", str(plan), "--backend", self.backend, "--out", str(out), *arguments)
            assert result.returncode == 2, result.stderr
            assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line
            assert f"the {self.backend} backend has no" in result.stderr
            assert not out.exists()  # refused before the output folder or any process
