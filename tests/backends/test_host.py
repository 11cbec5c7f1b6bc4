"""The free port a launcher hands its workers lies below the kernel's ephemeral range: a port
inside it can be taken as the source port of any connection before its server binds it."""

from __future__ import annotations

import socket

from crosstrain.backends.host import LOWEST_PORT, _ephemeral_range, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    ports = {free_port() for _ in range(20)}
    low, _ = _ephemeral_range()
    assert all(LOWEST_PORT <= port < low for port in ports)
    assert len(ports) > 1  # drawn, not a fixed port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", ports.pop()))
