"""What a worker process takes from the machine it runs on, with no framework: a free port
for its group to meet at, and the threads it computes with on a CPU."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

#: threads a worker process computes with on a CPU (torch's, and each of TensorFlow's two
#: pools): N workers on N cores each spawning N threads oversubscribe the cores
#: (docs/performance.md#measurements-behind-the-code)
CPU_THREADS = 1


#: where :func:`free_port` draws from: above the well-known and most services' ports, below
#: the kernel's range of ephemeral ports (the source port of every outgoing connection)
LOWEST_PORT = 10000
#: Linux's default ephemeral range, where /proc does not say
_EPHEMERAL = (32768, 60999)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, drawn at random below the ephemeral range. A port the
    kernel picks (binding port 0) lies inside that range, so a connection opened anywhere on
    the machine may take it as its source port in the seconds before the server meant to use
    it binds it (a TensorFlow worker takes several to start): its peers then reach no one."""
    draw = random.Random(os.urandom(8))
    highest = _ephemeral_range()[0] - 1
    for _ in range(100):
        port = draw.randint(LOWEST_PORT, highest) if highest > LOWEST_PORT else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:  # taken: draw again
                continue
            return int(probe.getsockname()[1])
    raise OSError(f"no free port on {host} between {LOWEST_PORT} and {highest}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL
