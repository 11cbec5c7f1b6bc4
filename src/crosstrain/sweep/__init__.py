"""``crosstrain sweep PLAN``: a hyperparameter search over a plan's fields, on Optuna.

Each trial is an ordinary run (``crosstrain run`` in a process of its own) into
``SWEEP/trials/<number>/``; the study lives in ``SWEEP/study.sqlite`` beside them, so
running the same command again continues the sweep, and a killed sweep loses no finished
trial. :mod:`~crosstrain.sweep.space` parses ``--search FIELD=SPACE``,
:mod:`~crosstrain.sweep.trials` runs the trials, :mod:`~crosstrain.sweep.pruning` is the
plugin that reports each evaluation to the study and stops a pruned trial, and
:mod:`~crosstrain.sweep.report` writes the table, ``best.toml`` and ``sweep.png``.
"""
