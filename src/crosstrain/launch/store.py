"""A small key/value store over TCP, for the one thing a framework without a rendezvous
needs across machines: every worker's address, before any worker starts.

tf's ``MultiWorkerMirroredStrategy`` takes the whole cluster up front (TF_CONFIG), and a
machine knows only its own free ports. So rank 0 (node 0) serves this store at the
meeting point (``--rdzv-endpoint``, or the environment's exchange port); every
participant puts its addresses under its own key and reads everyone's, with a deadline.
No framework, no pickle: one JSON line per request, one per reply.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from crosstrain.core.errors import InputError

_POLL_SECONDS = 0.1
_REQUEST_SECONDS = 10.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _Handler(socketserver.StreamRequestHandler):
    server: _StoreServer

    def handle(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            request = json.loads(self.rfile.readline())
            self.wfile.write(json.dumps(self.server.answer(request)).encode() + b"\n")


class _StoreServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]) -> None:
        self.values: dict[str, Any] = {}
        self.lock = threading.Lock()
        super().__init__(address, _Handler)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if request.get("op") == "set":
                self.values[str(request["key"])] = request["value"]
                return {"ok": True}
            return {"value": self.values.get(str(request.get("key")))}


@contextlib.contextmanager
def serve_store(host: str, port: int) -> Iterator[None]:
    """Serve the store at ``host:port`` for the block (the whole launch: a late peer may
    still be reading)."""
    # on loopback, loopback only; else every interface: the name the peers use (a Kubeflow
    # service, a SLURM node name) need not be an address this machine can bind
    bind = host if host in _LOOPBACK else "0.0.0.0"
    try:
        server = _StoreServer((bind, port))
    except OSError as error:
        raise InputError(f"cannot serve the address exchange at {host}:{port}: {error.strerror}") from None
    thread = threading.Thread(target=server.serve_forever, args=(_POLL_SECONDS,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _request(host: str, port: int, message: dict[str, Any], deadline: float) -> tuple[dict[str, Any], str]:
    """One request; the reply and this side's address as the store saw it. Retried until
    ``deadline`` while the store is not up yet (node 0 may start last)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=_REQUEST_SECONDS) as connection:
                own_address = str(connection.getsockname()[0])
                connection.sendall(json.dumps(message).encode() + b"\n")
                reply = connection.makefile("rb").readline()
            return dict(json.loads(reply)), own_address
        except (OSError, ValueError) as error:
            if time.monotonic() > deadline:
                raise InputError(f"address exchange at {host}:{port}: cannot reach it ({error})") from None
            time.sleep(_POLL_SECONDS)


def exchange(
    host: str, port: int, key: str, value: Any, keys: Sequence[str], timeout_seconds: float
) -> dict[str, Any]:
    """Put ``value`` under ``key`` in the store at ``host:port``, then wait until every one
    of ``keys`` has a value and return them. Raises :class:`InputError` naming the missing
    keys when ``timeout_seconds`` pass first: never a hang."""
    deadline = time.monotonic() + timeout_seconds
    _request(host, port, {"op": "set", "key": key, "value": value}, deadline)
    found: dict[str, Any] = {}
    while True:
        for wanted in keys:
            if wanted not in found:
                reply, _ = _request(host, port, {"op": "get", "key": wanted}, deadline)
                if reply.get("value") is not None:
                    found[wanted] = reply["value"]
        if len(found) == len(keys):
            return found
        if time.monotonic() > deadline:
            missing = ", ".join(wanted for wanted in keys if wanted not in found)
            raise InputError(
                f"address exchange at {host}:{port}: no word from {missing} within {timeout_seconds:g} s"
            )
        time.sleep(_POLL_SECONDS)


def reachable_address(host: str, port: int, timeout_seconds: float) -> str:
    """This machine's address as the store at ``host:port`` sees it: the one its peers
    reach it by (the interface that routes there; 127.0.0.1 on loopback)."""
    _, own = _request(host, port, {"op": "get", "key": ""}, time.monotonic() + timeout_seconds)
    return own
