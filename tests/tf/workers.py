"""Checks that need TensorFlow's replicas in hand, run in a fresh process: logical CPU
devices must be configured before TensorFlow's first op, so never in pytest's process.

    python -c "from tests.tf.workers import main; main()" DIGITS_PLAN ODD_NPZ_PLAN
    python -c "from tests.tf.workers import graph_main; graph_main()" PLAN...
    python -c "from tests.tf.workers import prefetch_main; prefetch_main()" OUT_DIR PLAN...

prints one JSON line with what it measured; the tests assert on it. It goes through the
same pieces as `crosstrain run`: configure_devices, MirroredStrategy, TfStrategy, the
core sampler and evaluate(). ``graph_main`` trains and evaluates each plan at one and two
replicas (plans with batch norm, dropout, token ids and attention); ``prefetch_main`` trains
each plan through core's loop at two replicas, with and without the host's rows read ahead
to the replicas' devices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from crosstrain.backends.tf.launch import Layout
from crosstrain.backends.tf.strategy import TfState, TfStrategy
from crosstrain.backends.tf.worker import configure_devices
from crosstrain.core.data.batches import Batch, GlobalSampler, step_batch
from crosstrain.core.run.evaluation import evaluate
from crosstrain.core.run.job import Job, World
from crosstrain.core.run.job import Layout as JobLayout
from crosstrain.core.run.loading import load_datasets
from crosstrain.core.run.loop import initial_weights, train
from crosstrain.core.spec.plan import Plan
from crosstrain.core.spec.planfile import load_plan
from tests.support import StepRecorder

STEPS = 6


def _strategies() -> tuple[TfStrategy, TfStrategy]:
    """One replica on /cpu:0 and two replicas on /cpu:0 and /cpu:1, in this process."""
    import tensorflow as tf

    configure_devices(Layout(workers=1, local_replicas=2, device="cpu"), 0)
    one = TfStrategy(World(local_replicas=1), tf.distribute.MirroredStrategy(["/cpu:0"]))
    two = TfStrategy(World(local_replicas=2), tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return one, two


def _replica_mismatches(state: TfState) -> list[str]:
    """Variables (weights, batch norm's moving statistics and optimizer slots) whose two
    replica copies differ at all."""
    named = [(v.path, v.value) for v in state.model.weights]
    named += [(f"slot {i}.{j}", slot) for i, slots in enumerate(state.slots) for j, slot in enumerate(slots)]
    mismatched = []
    for name, variable in named:
        copies = [np.asarray(copy.numpy()) for copy in variable.values]
        if len(copies) != 2 or not np.array_equal(copies[0], copies[1]):
            mismatched.append(name)
    return mismatched


def train_both(plan: Plan, one: TfStrategy, two: TfStrategy) -> dict[str, Any]:
    """The same steps at one and two replicas, the last batch padded with weight 0."""
    data = load_datasets(plan).train
    states = {name: s.build(plan, initial_weights(plan)) for name, s in (("one", one), ("two", two))}
    losses: dict[str, list[float]] = {"one": [], "two": []}
    batches = list(GlobalSampler(len(data), plan.train.global_batch_size, plan.seed).epoch(0))[:STEPS]
    batches[-1][1][-5:] = 0.0  # padding rows must count for nothing
    for number, (indices, weight) in enumerate(batches):
        step = step_batch(data, indices, weight, 0, 1, plan.train.grad_accum_steps, step=number)
        for name, strategy in (("one", one), ("two", two)):
            losses[name].append(float(strategy.train_step(states[name], step, 0.05)["loss"]))
    weights_one, weights_two = (s.state_dict(states[n]) for n, s in (("one", one), ("two", two)))
    first = np.arange(32)
    half = Batch(data.x[first], data.y[first], np.repeat(np.float32([1, 0]), 16))
    return {
        "losses_one": losses["one"],
        "losses_two": losses["two"],
        "max_weight_difference": max(
            float(np.max(np.abs(weights_one[k] - weights_two[k]))) for k in weights_one
        ),
        "replica_mismatches": _replica_mismatches(states["two"]),
        "traces": int(states["two"].train_function.experimental_get_tracing_count()),
        # only replica 0's rows are real: each replica must count its own rows
        "half_batch_count": two.eval_step(states["two"], half)["count"],
        "targets_per_row": data.targets_per_row,
        "weights_two": sorted(weights_two),
    }


def eval_both(plan: Plan, one: TfStrategy, two: TfStrategy) -> dict[str, Any]:
    """Evaluate the initial weights at both worlds: any difference comes from evaluation."""
    evaluation = load_datasets(plan).eval
    assert evaluation is not None
    results = {}
    for name, strategy in (("one", one), ("two", two)):
        state = strategy.build(plan, initial_weights(plan))
        results[f"eval_{name}"] = evaluate(strategy, state, evaluation, plan)
    return results


def main() -> None:
    digits_plan, npz_plan = sys.argv[1:3]
    one, two = _strategies()
    results = train_both(load_plan(digits_plan), one, two)
    results.update(eval_both(load_plan(npz_plan), one, two))
    print(json.dumps(results))


def graph_main() -> None:
    """Train and evaluate each plan given at one and two replicas: {plan name: results}."""
    one, two = _strategies()
    results = {}
    for path in sys.argv[1:]:
        plan = load_plan(path)
        results[plan.name] = {**train_both(plan, one, two), **eval_both(plan, one, two)}
    print(json.dumps(results))


def prefetch_main() -> None:
    """Train each plan given through core's loop (``train``) at two replicas on /cpu:0 and
    /cpu:1, once reading each step's host rows in the step and once reading them ahead to
    the replicas' devices: {plan name: per-step losses of both, final weights' largest
    difference, steps that found their rows read ahead}."""
    import tensorflow as tf

    configure_devices(Layout(workers=1, local_replicas=2, device="cpu"), 0)
    # one distribution for every run: each would number its collectives from the same key
    distribution = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out, results = Path(sys.argv[1]), {}
    for path in sys.argv[2:]:
        plan = load_plan(path)
        runs = {}
        for prefetch in (False, True):
            strategy = TfStrategy(World(local_replicas=2), distribution, prefetch)
            recorder = StepRecorder()
            job = Job(plan=plan, layout=JobLayout("tf", 1), out_dir=str(out / f"{plan.name}-{prefetch}"))
            _, state = train(strategy, job, recorder)  # type: ignore[arg-type]
            prefetcher = state.feed.prefetcher
            runs[prefetch] = (
                recorder.losses,
                strategy.state_dict(state),
                0 if prefetcher is None else prefetcher.pending.taken,
                # the function taking the replicas' own rows, traced once for every step
                [
                    int(function.experimental_get_tracing_count())
                    for (kind, key), function in state.functions.items()
                    if kind == "train" and isinstance(key, tuple) and key[0] == "per replica"
                ],
            )
        (losses, weights, *_), (prefetched_losses, prefetched_weights, taken, traces) = (
            runs[False],
            runs[True],
        )
        results[plan.name] = {
            "losses": losses,
            "prefetched_losses": prefetched_losses,
            "max_weight_difference": max(
                float(np.max(np.abs(weights[k] - prefetched_weights[k]))) for k in weights
            ),
            "prefetched_steps": taken,
            "traces": traces,
        }
    print(json.dumps(results))
