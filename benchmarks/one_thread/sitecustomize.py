"""On the PYTHONPATH of `crosstrain run --backend tf` in bench_e2e.py (CPU): one thread.

crosstrain's tf worker sizes TensorFlow's intra-op pool to ``os.cpu_count() // local
workers`` (2 threads on a 2-core machine), while the benchmark's native loops and the torch
backend run on one thread. Python runs this module at start-up in every process of that
run, so the worker sees one core and the comparison is thread for thread. Benchmark only.
"""

import os

os.cpu_count = lambda: 1
