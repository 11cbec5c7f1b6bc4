"""Experiment trackers as built-in plugins: ``crosstrain run PLAN --mlflow [TRACKING_URI]``
and ``--wandb [PROJECT]``, shaped like ``--tensorboard``.

Each logs, from rank 0 only: the run's parameters (the flattened plan, the backend, the
world, the framework versions), every step's loss, learning rate and throughput, every
evaluation, and at the end the plan, the summary, the final weights and the curve plot as
artifacts. A resumed or continued run logs into the same tracker run (its id is kept in the
run folder's ``trackers.json``). A tracker that fails gives one warning line and is closed;
training and ``metrics.jsonl`` go on untouched. :mod:`crosstrain.tracking.base` holds what
the trackers share; each tracker module adds its client and its option.
"""
