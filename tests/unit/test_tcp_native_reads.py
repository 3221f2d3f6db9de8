"""kvbrokerd._tcpread: the tcp data port's READs served without Python, against a socket pair (no daemon).

What a peer sends is never trusted: a frame the table cannot answer whole (a WRITE, too many runs, an unknown cache, a
run outside its tensor, too many bytes) goes back to Python unanswered, with the bytes read so far."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbrokerd.backends.tcp import wire as tcp

try:
    from kvbrokerd import _tcpread
except ImportError:  # pragma: no cover - a machine without a C compiler: every read takes the Python path
    _tcpread = None  # type: ignore[assignment]

needs_extension = pytest.mark.skipif(_tcpread is None, reason="kvbrokerd._tcpread is not built here")

NOT_EXIST = 7
CACHE = 42
TENSOR_BYTES = 1 << 16


def _frame(cache_id: int, runs: list[tuple[int, int, int]], magic: bytes = b"KVRQ", deadline_ms: int = 5000) -> bytes:
    frame = np.zeros(len(runs), dtype=tcp.RUN)
    if runs:
        frame["tensor"], frame["offset"], frame["length"] = zip(*runs, strict=True)
    return tcp.REQUEST.pack(magic, len(runs), cache_id, deadline_ms, 0) + frame.tobytes()


def _serve(table: object, sock: socket.socket, max_bytes: int = 4 << 20, max_runs: int = 64,
           idle_s: float = 5.0) -> bytes | int | None:
    result: bytes | int | None = table.serve(sock.fileno(), idle_s, 5.0, 5.0, 300.0, 0.0, 10.0,  # type: ignore[attr-defined]
                                             max_bytes, max_runs, NOT_EXIST)
    return result


def _recv(sock: socket.socket, n: int) -> bytes:
    return sock.recv(n, socket.MSG_WAITALL)


@contextlib.contextmanager
def _served(tensors: np.ndarray) -> Iterator[tuple[object, socket.socket, socket.socket]]:
    table = _tcpread.ReadTable()
    table.put(CACHE, tensors.shape[1], np.array([t.ctypes.data for t in tensors], dtype=np.uint64))
    server, peer = socket.socketpair()
    peer.settimeout(10)
    with server, peer:
        yield table, server, peer


def _read_reply(peer: socket.socket, total: int) -> tuple[bytes, tuple[bytes, int, int]]:
    assert tcp.REPLY.unpack(_recv(peer, tcp.REPLY.size)) == (b"KVRS", 0, total)
    payload = _recv(peer, total)
    return payload, tcp.TRAILER.unpack(_recv(peer, tcp.TRAILER.size))


def test_the_extension_is_built_where_a_compiler_and_headers_are() -> None:
    """Keeps the tests below from skipping silently where the install step could have built it."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    compiler = any(os.access(Path(d) / cc, os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)
                   for cc in ("cc", "gcc"))
    if not (compiler and headers.exists()):
        pytest.skip("no C compiler or no Python headers: the Python path is the expected fallback")
    assert _tcpread is not None, "pip install -e . should have built kvbrokerd._tcpread here"


@needs_extension
def test_reads_are_served_until_the_peer_leaves() -> None:
    tensors = np.random.default_rng(1).integers(0, 256, (3, TENSOR_BYTES), dtype=np.uint8)
    with _served(tensors) as (table, server, peer):
        runs = [(2, 100, 4000), (0, 0, 64), (1, TENSOR_BYTES - 10, 10)]
        peer.sendall(_frame(CACHE, runs) + _frame(CACHE, [(1, 0, TENSOR_BYTES)]))
        peer.shutdown(socket.SHUT_WR)  # after both requests: serve() answers them, then sees the peer gone
        assert _serve(table, server) is None
        payload, trailer = _read_reply(peer, 4074)
        assert payload == b"".join(tensors[t, o : o + n].tobytes() for t, o, n in runs)
        assert trailer == (b"KVEN", 0, 4074)
        payload, trailer = _read_reply(peer, TENSOR_BYTES)
        assert payload == tensors[1].tobytes() and trailer == (b"KVEN", 0, TENSOR_BYTES)


@needs_extension
@pytest.mark.parametrize(("frame", "whole"), [
    (_frame(CACHE, [(3, 0, 8)]), True),                                    # no such tensor
    (_frame(CACHE, [(0, TENSOR_BYTES - 8, 9)]), True),                     # past the tensor's end
    (_frame(CACHE, [(0, 0, 0)]), True),                                    # an empty run
    (_frame(CACHE, [(0, 2**64 - 8, 16)]), True),                           # an offset that wraps around
    (_frame(CACHE + 1, [(0, 0, 8)]), True),                                # a cache the table does not hold
    (_frame(CACHE, [(0, 0, TENSOR_BYTES), (1, 0, TENSOR_BYTES)]), True),   # more bytes than max_bytes
    (_frame(CACHE, [(0, 0, 8)], magic=b"KVWR"), False),                    # a WRITE
    (_frame(CACHE, [(0, 0, 8)] * 65), False),                              # more runs than max_runs
    (_frame(CACHE, []), False),                                            # no runs
    (b"GARBAGE!" * 3, False),                                              # not a request at all
], ids=["tensor", "past-end", "empty-run", "wrapping-offset", "unknown-cache", "too-many-bytes", "write",
        "too-many-runs", "no-runs", "garbage"])
def test_what_the_table_cannot_answer_goes_back_to_python_unanswered(frame: bytes, whole: bool) -> None:
    tensors = np.zeros((3, TENSOR_BYTES), dtype=np.uint8)
    with _served(tensors) as (table, server, peer):
        peer.sendall(frame)
        handed = _serve(table, server, max_bytes=TENSOR_BYTES)
        # The head (24 bytes) always; the runs too when serve() read them (Python reads the rest itself).
        assert handed == (frame if whole else frame[: tcp.REQUEST.size])
        peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer.recv(1)  # nothing was sent


@needs_extension
def test_a_peer_that_sends_half_a_frame_and_stops_times_out() -> None:
    with _served(np.zeros((1, TENSOR_BYTES), dtype=np.uint8)) as (table, server, peer):
        peer.sendall(_frame(CACHE, [(0, 0, 8)])[:10])
        with pytest.raises(TimeoutError):
            table.serve(server.fileno(), 5.0, 0.2, 5.0, 300.0, 0.0, 10.0, 1 << 20, 64, NOT_EXIST)  # type: ignore[attr-defined]


@needs_extension
def test_an_idle_peer_ends_the_connection() -> None:
    with _served(np.zeros((1, TENSOR_BYTES), dtype=np.uint8)) as (table, server, _):
        assert _serve(table, server, idle_s=0.05) is None


@needs_extension
def test_drop_waits_for_a_read_and_that_read_gives_up_when_its_peer_stops_reading() -> None:
    """A peer asks for more than the socket buffers hold and never reads: drop() (the registry removing the cache,
    before it unmaps it) returns once serve() gave up, and serve() says why."""
    tensors = np.zeros((1, 4 << 20), dtype=np.uint8)
    with _served(tensors) as (table, server, peer):
        peer.sendall(_frame(CACHE, [(0, 0, 4 << 20)], deadline_ms=60_000))
        outcome: list[BaseException | object] = []

        def serve() -> None:
            try:
                outcome.append(_serve(table, server))
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=serve)
        thread.start()
        assert _recv(peer, tcp.REPLY.size)[:4] == b"KVRS"  # the read is under way: it uses the cache
        assert table.drop(CACHE)  # type: ignore[attr-defined]
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert isinstance(outcome[0], ConnectionAbortedError), outcome
        assert table.size() == 0  # type: ignore[attr-defined]
        assert not table.drop(CACHE)  # type: ignore[attr-defined]


@needs_extension
def test_a_peer_that_reads_below_the_minimum_rate_is_abandoned() -> None:
    """THREAT_MODEL T25 on the native path: a peer that keeps reading, but a trickle, never trips the stall timeout;
    the minimum rate (here 1 MiB/s judged per 0.2 s window) ends the read, and the cache is free again."""
    tensors = np.zeros((1, 4 << 20), dtype=np.uint8)
    with _served(tensors) as (table, server, peer):
        peer.sendall(_frame(CACHE, [(0, 0, 4 << 20)], deadline_ms=60_000))
        stop = threading.Event()

        def trickle() -> None:
            with contextlib.suppress(OSError):
                while not stop.wait(0.05) and peer.recv(1024):
                    pass

        reader = threading.Thread(target=trickle)
        reader.start()
        try:
            with pytest.raises(TimeoutError, match="minimum rate"):
                table.serve(server.fileno(), 5.0, 5.0, 30.0, 300.0, float(1 << 20), 0.2, 4 << 20, 64,  # type: ignore[attr-defined]
                            NOT_EXIST)
        finally:
            stop.set()
            reader.join(timeout=10)
        assert table.drop(CACHE)  # type: ignore[attr-defined]


@needs_extension
def test_memory_that_vanishes_under_a_read_is_padded_with_zeros_and_reported(tmp_path: Path) -> None:
    """The model server truncates the segment of a served cache: the kernel refuses the send (EFAULT), the reply
    goes on with zeros, its trailer says how many leading bytes were the source's, and the connection stays usable."""
    page = mmap.PAGESIZE
    path = tmp_path / "segment"
    path.write_bytes(b"\x05" * (4 * page))
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, 4 * page)
        base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        table = _tcpread.ReadTable()
        table.put(CACHE, 4 * page, np.array([base], dtype=np.uint64))
        server, peer = socket.socketpair()
        peer.settimeout(10)
        with server, peer:
            os.ftruncate(fd, page)  # pages 1..3 are gone
            peer.sendall(_frame(CACHE, [(0, 0, page), (0, page, page)]))
            peer.shutdown(socket.SHUT_WR)
            assert _serve(table, server) == CACHE  # answered, and reported
            assert _serve(table, server) is None  # still in step: the next request (none) is read
            assert tcp.REPLY.unpack(_recv(peer, tcp.REPLY.size)) == (b"KVRS", 0, 2 * page)
            payload = _recv(peer, 2 * page)
            magic, status, good = tcp.TRAILER.unpack(_recv(peer, tcp.TRAILER.size))
            assert (magic, status) == (b"KVEN", NOT_EXIST) and good <= page
            assert payload[:good] == b"\x05" * good and payload[page:] == bytes(page)
        table.drop(CACHE)
        del base
        with contextlib.suppress(BufferError):
            mapping.close()
    finally:
        os.close(fd)


@needs_extension
def test_put_keeps_the_first_entry_of_a_cache() -> None:
    table = _tcpread.ReadTable()
    table.put(CACHE, 8, np.array([1], dtype=np.uint64))
    table.put(CACHE, 16, np.array([2, 3], dtype=np.uint64))
    assert table.size() == 1
    with pytest.raises(ValueError):
        table.put(CACHE + 1, 8, np.array([], dtype=np.uint64))
    assert struct.calcsize("<Q") == 8 and table.drop(CACHE)


@pytest.mark.parametrize("native_reads", [pytest.param(True, marks=needs_extension), False],
                         ids=["native", "python"])
def test_the_data_server_serves_reads_natively_and_hands_the_rest_to_python(tmp_path: Path, native_reads: bool,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real DataServer: a cache joins the native table when it joins the registry and leaves it when it
    is removed; on one connection, native READs, a refused READ and a WRITE (both answered by Python) stay in step.
    Without the extension every request takes the Python path, with the same answers."""
    import asyncio

    from kvbroker.types import CacheDesc, DataType
    from kvbrokerd.backends.tcp import native
    from kvbrokerd.backends.tcp import server as tcp_server
    from kvbrokerd.errors import LlmStatus
    from kvbrokerd.links import linkauth
    from kvbrokerd.registry.caches import Registry
    from tests import dataport

    if not native_reads:
        monkeypatch.setattr(native, "available", lambda: False)
    registry = Registry(tmp_path / "shm")
    registry.open()
    secret = linkauth.new_secret()
    server = tcp_server.DataServer(registry, lambda _: secret, "127.0.0.1")
    server.start()
    table = server._native
    assert (table is not None) == native_reads
    try:
        entry = registry.allocate(CacheDesc(num_tensors=2, shape=(4, 1024), data_type=DataType.UINT8))
        assert table is None or table.size() == 1
        np.frombuffer(entry.views[1], dtype=np.uint8)[:] = np.arange(4096) % 251
        with contextlib.closing(dataport.connect(server.port, secret)) as sock:
            def read(runs: list[tuple[int, int, int]]) -> tuple[int, bytes]:
                sock.sendall(dataport.read_request(entry.cache_id, runs, 5000))
                _, status, size = tcp.REPLY.unpack(_recv(sock, tcp.REPLY.size))
                if status:
                    return status, _recv(sock, size)
                payload = _recv(sock, size)
                assert tcp.TRAILER.unpack(_recv(sock, tcp.TRAILER.size)) == (b"KVEN", 0, size)
                return 0, payload

            assert read([(1, 1024, 2048)]) == (0, (np.arange(1024, 3072) % 251).astype(np.uint8).tobytes())
            assert read([(2, 0, 8)])[0] == LlmStatus.LLM_PARAM_INVALID
            sock.sendall(b"KVWR" + dataport.read_request(entry.cache_id, [(0, 0, 4)], 5000)[4:])
            assert tcp.REPLY.unpack(_recv(sock, tcp.REPLY.size)) == (b"KVRS", 0, 4)
            sock.sendall(b"abcd")
            assert tcp.REPLY.unpack(_recv(sock, tcp.REPLY.size)) == (b"KVRS", 0, 4)
            assert read([(0, 0, 4), (1, 0, 2)]) == (0, b"abcd" + bytes([0, 1]))
        asyncio.run(registry.remove(entry.cache_id, daemon_owned=True))
        assert table is None or table.size() == 0
    finally:
        server.close()
        registry.close()


@pytest.mark.parametrize("setting", ["0", "1"])
def test_the_native_reader_can_be_turned_off_from_the_environment(setting: str) -> None:
    """`KVBROKER_TCP_NATIVE=0` (to compare, or to rule the extension out): every READ takes the Python path."""
    import subprocess
    import sys

    probe = "from kvbrokerd.backends.tcp import native; print(native.available())"
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "KVBROKER_TCP_NATIVE": setting}).stdout.strip()
    from kvbrokerd.backends.tcp import native

    assert got == ("False" if setting == "0" else str(native.available()))
