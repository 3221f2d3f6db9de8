"""The tcp data server's accept loop: it outlives accept errors and reports whether it can take connections.

The errors are injected by wrapping the real listening socket (a real EMFILE, from a daemon run with a low
descriptor limit, is in tests/integration/test_dataplane_robustness.py); everything else is the real server.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kvbrokerd.backends.tcp import server as tcp
from kvbrokerd.links import linkauth
from kvbrokerd.registry.caches import Registry


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


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_accept_errors_turn_serving_off_then_on_and_the_loop_goes_on(tmp_path: Path) -> None:
    changes: list[bool] = []
    server = tcp.DataServer(Registry(tmp_path), lambda _: None, "127.0.0.1", on_serving_change=changes.append)
    listener = _FailingListener(server._listener, errno.EMFILE)
    server._listener = listener  # type: ignore[assignment]
    server.start()
    try:
        assert server.serving and changes == [True]
        listener.failing.set()
        pending = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # accept() now fails on it
        _wait_for(lambda: listener.failures >= 3)
        assert not server.serving and changes == [True, False]
        failures = listener.failures
        time.sleep(0.5)
        assert listener.failures - failures <= 10  # backing off, not spinning
        listener.failing.clear()
        assert pending.recv(4, socket.MSG_WAITALL) == b"KVCH"  # the waiting connection is served after all
        pending.close()
        _wait_for(lambda: server.serving)
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
        _wait_for(lambda: listener.failures >= 1)  # (the loop polls accept() every _ACCEPT_POLL_S)
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
            started = time.monotonic()
            closed_after = None
            for _ in range(40):  # one byte every 0.1 s: each recv() alone would never time out
                try:
                    sock.sendall(b"K")
                    sock.settimeout(0.1)
                    if sock.recv(1) == b"":
                        closed_after = time.monotonic() - started
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - started
                    break
            assert closed_after is not None and 0.8 <= closed_after < 2.0, closed_after
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
