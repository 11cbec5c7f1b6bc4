"""How the shared launcher starts a worker process: glibc's malloc tuned for training,
unless the user set malloc up themselves."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from crosstrain.launch.process import (
    MALLOC_SETTINGS,
    MALLOC_TUNABLES,
    start_process,
    tuned_children,
    worker_environment,
)

#: a step's worth of blocks (eight of 1 MiB, written) made and freed again and again; prints
#: the page faults of the last ten rounds
STEPS_OF_BLOCKS = """
import resource, sys
import numpy as np

def one_step():
    blocks = [np.ones(1 << 18, np.float32) for _ in range(8)]
    del blocks

one_step(); one_step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_step()
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def test_a_worker_gets_mallocs_tunables_unless_the_user_set_malloc_up() -> None:
    assert worker_environment({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": MALLOC_TUNABLES}
    for own in ({"GLIBC_TUNABLES": "glibc.malloc.check=0"}, {"LD_PRELOAD": "libjemalloc.so.2"}):
        assert worker_environment(own) == own


def test_children_of_the_block_get_the_tunables_and_the_environment_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    with tuned_children():
        assert os.environ["GLIBC_TUNABLES"] == MALLOC_TUNABLES
    assert "GLIBC_TUNABLES" not in os.environ


def _faults(tmp_path: Path, environment: dict[str, str]) -> int:
    out = tmp_path / f"faults-{len(list(tmp_path.iterdir()))}"
    worker = start_process([sys.executable, "-c", STEPS_OF_BLOCKS, str(out)], environment)
    assert worker.wait(timeout=60) == 0
    return int(out.read_text())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tunables are glibc's")
def test_a_worker_reuses_its_freed_memory_instead_of_faulting_it_in_every_step(tmp_path: Path) -> None:
    """By default glibc hands a step's freed blocks back to the system and faults them in
    again the next step (measured here: ~20,000 page faults over ten steps); a worker the
    launcher starts reuses them."""
    environment = {name: value for name, value in os.environ.items() if name not in MALLOC_SETTINGS}
    tuned = _faults(tmp_path, environment)
    default = _faults(tmp_path, environment | {"GLIBC_TUNABLES": ""})  # the user's own: none
    assert default > 8 * 256 * 5  # at least half the rounds fault in their 8 MiB again
    assert tuned < default / 20
