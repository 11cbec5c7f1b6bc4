"""The address exchange tf needs across machines: real sockets on loopback, threads as
the participants, and a deadline instead of a hang."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from crosstrain.backends.host import free_port
from crosstrain.core.errors import InputError
from crosstrain.launch.store import exchange, reachable_address, serve_store


def test_every_participant_reads_everyones_values_even_before_the_store_is_up() -> None:
    port = free_port()
    found: dict[str, dict[str, Any]] = {}

    def participant(key: str, value: list[str]) -> None:
        found[key] = exchange("127.0.0.1", port, key, value, ["node-0", "node-1"], timeout_seconds=20)

    late = threading.Thread(target=participant, args=("node-1", ["127.0.0.1:2", "127.0.0.1:3"]))
    late.start()  # asks before node 0 serves: retried, not refused
    time.sleep(0.3)
    with serve_store("127.0.0.1", port):
        participant("node-0", ["127.0.0.1:1"])
        late.join(timeout=20)
        assert reachable_address("127.0.0.1", port, 5) == "127.0.0.1"
    expected = {"node-0": ["127.0.0.1:1"], "node-1": ["127.0.0.1:2", "127.0.0.1:3"]}
    assert found == {"node-0": expected, "node-1": expected}


def test_a_participant_that_never_comes_is_named_within_the_deadline() -> None:
    port = free_port()
    started = time.monotonic()
    with serve_store("127.0.0.1", port), pytest.raises(InputError) as error:
        exchange("127.0.0.1", port, "rank-0", ["a:1"], ["rank-0", "rank-1"], timeout_seconds=0.5)
    assert str(error.value) == f"address exchange at 127.0.0.1:{port}: no word from rank-1 within 0.5 s"
    assert time.monotonic() - started < 5


def test_no_store_at_all_is_an_error_not_a_hang() -> None:
    port = free_port()
    with pytest.raises(InputError, match=f"address exchange at 127.0.0.1:{port}: cannot reach it"):
        exchange("127.0.0.1", port, "rank-1", ["a:1"], ["rank-0", "rank-1"], timeout_seconds=0.3)


def test_a_taken_port_is_named() -> None:
    port = free_port()
    taken = pytest.raises(InputError, match=f"cannot serve the address exchange at 127.0.0.1:{port}")
    with serve_store("127.0.0.1", port), taken, serve_store("127.0.0.1", port):
        pass
