"""What a worker process takes from the machine it runs on, with no framework: a free port
for its group to meet at, and the threads it computes with on a CPU."""

from __future__ import annotations

import socket

#: threads a worker process computes with on a CPU (torch's, and each of TensorFlow's two
#: pools): N workers on N cores each spawning N threads oversubscribe the cores
#: (docs/performance.md#measurements-behind-the-code)
CPU_THREADS = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, chosen by the kernel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
