"""Step-by-step agreement with the torch reference, the suite a backend runs beside torch:
subclass :class:`AgreesWithTorch` as :class:`~crosstrain.testing.conformance.BackendConformance`
(crosstrain's tf suite does, and the third-party jax plugin's)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from crosstrain.testing.launches import (
    PLANS,
    RunCache,
    SharesRuns,
    write_plan,
)
from crosstrain.testing.run_checks import (
    PARITY_TOLERANCE,
    fail_then_resume,
    spoken_plans,
    start_from,
)
from crosstrain.testing.runs import assert_same_eval, max_relative_difference, step_losses, summary


class AgreesWithTorch(SharesRuns):
    """Step-by-step agreement with the torch reference on every plan the backend speaks
    (needs torch installed beside the backend: crosstrain's frameworks env, a third party's
    own tests). Subclass it like :class:`~crosstrain.testing.conformance.BackendConformance`;
    in one session the world-N runs are the backend suite's own, and torch's reference runs
    are shared by every backend."""

    backend: ClassVar[str]
    nproc: ClassVar[int] = 2

    @pytest.mark.parametrize("plan", list(PLANS))
    def test_agrees_with_the_torch_reference(self, plan: str, runs: RunCache, tmp_path: Path) -> None:
        if plan not in spoken_plans(self.backend, tmp_path / "check"):
            pytest.skip(f"the {self.backend} backend does not speak this plan's layers")
        mine = runs(self.backend, plan, self.nproc)
        reference = runs("torch", plan, self.nproc)
        assert max_relative_difference(step_losses(mine), step_losses(reference)) <= PARITY_TOLERANCE
        assert_same_eval(
            summary(mine)["eval"], summary(reference)["eval"], loss_tolerance=PARITY_TOLERANCE, flips=1
        )

    def test_starts_from_the_torch_reference_s_weights(self, runs: RunCache, tmp_path: Path) -> None:
        """``--init-from`` a finished torch run: this backend's first (step-0) evaluation of
        the neutral weights is torch's final evaluation, within parity tolerance."""
        source = runs("torch", "dropout_mlp", self.nproc)
        plan = write_plan(tmp_path, "dropout_mlp")
        started = start_from(self.backend, plan, source, tmp_path / "run", self.nproc)
        assert_same_eval(started, summary(source)["eval"], loss_tolerance=PARITY_TOLERANCE, flips=1)

    def test_resumes_across_frameworks(self, runs: RunCache, tmp_path: Path) -> None:
        """A checkpoint's neutral weights and optimizer slots continue on the other framework:
        trained on this backend and resumed on torch, and the other way round, each run's
        steps agree with an uninterrupted torch run within parity tolerance."""
        plan = write_plan(tmp_path, "dropout_mlp")
        reference = step_losses(runs("torch", "dropout_mlp", self.nproc))
        for first, then in ((self.backend, "torch"), ("torch", self.backend)):
            out = fail_then_resume(first, plan, tmp_path / f"{first}-then-{then}", self.nproc, then)
            assert summary(out)["backend"] == then
            assert max_relative_difference(step_losses(out), reference) <= PARITY_TOLERANCE
