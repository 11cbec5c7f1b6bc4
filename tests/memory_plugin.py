"""A test plugin (`-p tests.memory_plugin`): each rank writes, at the end of training, how
much of its memory is anonymous (private to the process) and grew since training started,
and how much of the .npy files it maps is resident, to ``memory-rank{R}.json`` in the run
folder. Linux only (/proc/self/smaps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crosstrain.core.run.context import RunContext
from crosstrain.plugins.hookspecs import hookimpl

_START: dict[str, int] = {}


def _rollup_bytes(name: str) -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} line in /proc/self/smaps_rollup")


def _mapped_rss_bytes(suffix: str) -> int:
    """Resident bytes of the mappings of files whose path ends in ``suffix``: pages of the
    page cache, one copy for every process that maps the file."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            counting = len(fields) >= 6 and fields[-1].endswith(suffix)
        elif counting and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@hookimpl
def crosstrain_train_start(context: RunContext) -> None:
    _START["anonymous"] = _rollup_bytes("Anonymous")


@hookimpl
def crosstrain_train_end(context: RunContext, summary: Any) -> None:
    record = {
        "anonymous_grown": _rollup_bytes("Anonymous") - _START["anonymous"],
        "npy_resident": _mapped_rss_bytes(".npy"),
    }
    (context.out_dir / f"memory-rank{context.world.rank}.json").write_text(json.dumps(record))
