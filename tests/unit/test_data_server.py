"""The tcp data server's accept loop: it outlives accept errors and reports whether it can take connections.

The errors are injected by wrapping the real listening socket (a real EMFILE, from a daemon run with a low
descriptor limit, is in tests/integration/test_dataplane_robustness.py); everything else is the real server.
"""

from __future__ import annotations

import errno
import itertools
import socket
import threading
from pathlib import Path
from typing import Any

from kvbrokerd.backends.tcp import server as tcp
from kvbrokerd.backends.tcp import wire as tcp_wire
from kvbrokerd.links import linkauth
from kvbrokerd.registry.caches import Registry
from tests.helpers import wait_until


class _FailingListener:
    """The real listener, whose accept() fails with `error` while `failing` is set."""

    def __init__(self, real: socket.socket, error: int) -> None:
        self._real = real
        self._error = error
        self.failing = threading.Event()
        self.failures = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failing.is_set():
            self.failures += 1
            raise OSError(self._error, "injected")
        return self._real.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _greeted(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        return sock.recv(4, socket.MSG_WAITALL) == b"KVCH"


class _NotedWaits(threading.Event):
    """The server's stop event, noting every timed wait on it (the accept loop's back-off is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def test_accept_errors_turn_serving_off_then_on_and_the_loop_goes_on(tmp_path: Path) -> None:
    changes: list[bool] = []
    server = tcp.DataServer(Registry(tmp_path), lambda _: None, "127.0.0.1", on_serving_change=changes.append)
    listener = _FailingListener(server._listener, errno.EMFILE)
    server._listener = listener  # type: ignore[assignment]
    server._stop = stop = _NotedWaits()
    server.start()
    try:
        assert server.serving and changes == [True]
        listener.failing.set()
        pending = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # accept() now fails on it
        wait_until(lambda: listener.failures >= 5, timeout=5, poll=0.01, what="five failed accepts")
        assert not server.serving and changes == [True, False]
        # Backing off, not spinning: after each failure the loop waits, each wait twice the last (up to a cap).
        waits = [w for w in stop.waits[:4] if w is not None]
        assert len(waits) == 4 and waits[0] > 0, stop.waits
        assert all(later == min(2 * earlier, tcp._BACKOFF_MAX_S)
                   for earlier, later in itertools.pairwise(waits)), waits
        listener.failing.clear()
        assert pending.recv(4, socket.MSG_WAITALL) == b"KVCH"  # the waiting connection is served after all
        pending.close()
        wait_until(lambda: server.serving, timeout=5, poll=0.01, what="the server serving again")
        assert changes == [True, False, True]
        assert _greeted(server.port)
    finally:
        server.close()
    assert not server.serving and changes == [True, False, True]


def test_errors_of_one_connection_do_not_turn_serving_off(tmp_path: Path) -> None:
    changes: list[bool] = []
    server = tcp.DataServer(Registry(tmp_path), lambda _: None, "127.0.0.1", on_serving_change=changes.append)
    listener = _FailingListener(server._listener, errno.ECONNABORTED)
    server._listener = listener  # type: ignore[assignment]
    server.start()
    try:
        listener.failing.set()
        # (the loop polls accept() every _ACCEPT_POLL_S)
        wait_until(lambda: listener.failures >= 1, timeout=5, poll=0.01, what="a failed accept")
        listener.failing.clear()
        assert _greeted(server.port)
        assert changes == [True]
    finally:
        server.close()


def test_a_handshake_has_one_deadline_however_slowly_it_drips(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT_S", 1.0)
    server = tcp.DataServer(Registry(tmp_path), lambda _: linkauth.new_secret(), "127.0.0.1")
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            assert sock.recv(4 + linkauth.NONCE_BYTES, socket.MSG_WAITALL)[:4] == b"KVCH"
            closed_after = None
            # One byte every 0.1 s, never the whole hello: each recv() alone would never time out, and the server
            # cannot have judged the hello's contents. Only one deadline for the whole handshake closes it.
            for sent in range(1, tcp_wire.HELLO.size):
                try:
                    sock.sendall(b"K")
                    sock.settimeout(0.1)
                    if sock.recv(1) == b"":
                        closed_after = sent
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = sent
                    break
            assert closed_after is not None, f"still open after {tcp_wire.HELLO.size - 1} bytes dripped over 5 s"
    finally:
        server.close()


def test_the_oldest_pending_handshake_gives_way(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(tcp, "MAX_HANDSHAKES", 4)
    server = tcp.DataServer(Registry(tmp_path), lambda _: None, "127.0.0.1")
    server.start()
    try:
        silent = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
        for s in silent:
            assert s.recv(4 + linkauth.NONCE_BYTES, socket.MSG_WAITALL)[:4] == b"KVCH"
        newest = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert newest.recv(4, socket.MSG_WAITALL) == b"KVCH"
        silent[0].settimeout(5)
        assert silent[0].recv(1) == b""  # the oldest was dropped
        for s in [*silent, newest]:
            s.close()
    finally:
        server.close()
