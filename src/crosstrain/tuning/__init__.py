"""``crosstrain tune PLAN``: the learning rate (``--lr``, a range test on any backend) and
the micro-batch (``--batch``, on a GPU) a plan should use, found by running it.

:mod:`~crosstrain.tuning.lr_range` runs the range test and reads its curve,
:mod:`~crosstrain.tuning.divergence` is the plugin that ends it once the loss diverges,
:mod:`~crosstrain.tuning.batch` searches the largest micro-batch that fits, and
:mod:`~crosstrain.tuning.command` is the command line.
"""
