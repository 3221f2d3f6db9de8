"""`tcp` backend: the cross-host path over the daemons' own data sockets (not gRPC).

Wire format (little endian), one connection = one authenticated link, requests answered in order:

    CHALLENGE server -> client magic "KVCH", 32-byte random nonce
    HELLO   client -> server   magic "KVHI", u16 version, u16 reserved, 16-byte link id,
                               32-byte HMAC-SHA256(link secret, label || nonce || link id)   (see linkauth.py)
    READY   server -> client   magic "KVOK"                     (or the connection is closed: a stranger gets nothing)
    READ    client -> server   magic "KVRQ", u32 run count, i64 cache id, u32 deadline (ms from now), u32 reserved,
                               then per run: u32 tensor, u32 reserved, u64 offset, u64 length
    REPLY   server -> client   magic "KVRS", u32 LLM status, u64 payload bytes,
                               then the payload (every run's bytes in request order) or, on error, the message
    TRAILER server -> client   magic "KVEN", u32 LLM status, u64 leading payload bytes that are the source's
                               (after the payload of every READ answered OK)
    WRITE   client -> server   magic "KVWR", then as READ (runs name the server's destination bytes)
            server -> client   REPLY with no payload (or the error), then, if it was OK:
            client -> server   the payload;  server -> client  REPLY again once every byte is in its cache

Versions (HELLO): 1 = no deadline in requests, no TRAILER. 2 = both: the server bounds each request (and the pin
on its cache) by the sender's deadline, and a source whose memory vanishes mid-READ fails that read (the server pads
the payload with zeros and says so in the TRAILER) instead of the connection. Clients speak 2; servers accept both.

The server validates a whole request against its registry before a byte moves, and pins the cache meanwhile;
runs travel as scatter/gather lists (sendmsg / recvmsg_into) straight between the caches' memory. Nothing waits
without a bound: a handshake has one total deadline and the oldest pending one gives way when MAX_HANDSHAKES are
under way; a request's frame must arrive within REQUEST_TIMEOUT_S of its first byte; its payload moves within the
sender's deadline (at most MAX_REQUEST_S), gives up after STALL_TIMEOUT_S without progress and, once its cache is
being released, as soon as the other side stops taking bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import math
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from kvbroker.status import LlmError
from kvbrokerd import blocklocks, linkauth
from kvbrokerd.backends import memcopy, sockio, staging
from kvbrokerd.backends.base import (
    Backend,
    BackendUnusable,
    Capabilities,
    LocalContext,
    PeerChannel,
    PeerInfo,
    RemoteCache,
    run_parts,
)
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.planner import Pieces, Progress

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan
    from kvbrokerd.registry import CacheEntry, Registry

log = logging.getLogger(__name__)

NAME = "tcp"
CAPABILITIES = Capabilities(same_host_only=False, one_sided_read=False)
VERSION = 2
_SERVED_VERSIONS = (1, 2)
HELLO = struct.Struct(f"<4sHH{linkauth.ID_BYTES}s{linkauth.MAC_BYTES}s")
REQUEST = struct.Struct("<4sIqII")
_REQUEST_V1 = struct.Struct("<4sIq")
REPLY = struct.Struct("<4sIQ")
TRAILER = REPLY
RUN = np.dtype([("tensor", "<u4"), ("reserved", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_RUNS_PER_REQUEST = 1 << 16
HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 128
MAX_CONNECTIONS = 512
IDLE_TIMEOUT_S = 600.0
"""An authenticated connection may wait this long for its next request (clients retire pooled ones sooner)."""
REQUEST_TIMEOUT_S = 10.0
MAX_REQUEST_S = 300.0
"""Longest a request may run (and pin its cache), whatever deadline its sender announces; version 1 gets this."""
STALL_TIMEOUT_S = 10.0
SOCKET_BUFFER_BYTES = 4 << 20
# Pulls smaller than this use one connection; larger ones are spread over the pool.
_SPLIT_MIN_BYTES = 4 << 20
# Pulls at most this big run on the event loop (see TcpChannel.runs_on_loop).
_LOOP_MAX_BYTES = 1 << 20
_LOOP_MAX_RUNS = 64
# A client retires a pooled connection idle for longer than this (well before the server's IDLE_TIMEOUT_S).
_POOL_IDLE_S = 60.0
# The accept loop wakes this often to end handshakes past their deadline.
_ACCEPT_POLL_S = 0.25
_BACKOFF_MIN_S = 0.01
_BACKOFF_MAX_S = 1.0
# accept(2) errors that concern only the connection being accepted: the next accept is fine.
_CONNECTION_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.ENOPROTOOPT,
                                errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH,
                                errno.EINTR, errno.EAGAIN})


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def _shut(sock: socket.socket) -> None:
    """Wakes a thread blocked on `sock` (its call fails at once)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _fds_available() -> bool:
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return False
    return True


# -- serving side -------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Conn:
    """A served connection; `sock` becomes the TLS socket once wrapped (shutting that down wakes its thread)."""

    sock: socket.socket


class DataServer:
    """Accepts data connections from linked peers and serves reads and writes of registered caches (a thread per
    connection).

    `serving` is False while the data port cannot take connections (e.g. the process ran out of file
    descriptors); the accept loop backs off and goes on, and `on_serving_change(serving)` is called on each change,
    from the accept thread (hand it to the event loop with `call_soon_threadsafe`), so that health can follow.
    """

    def __init__(self, registry: Registry, secret_for: Callable[[bytes], bytes | None], host: str,
                 port: int = 0, tls: ssl.SSLContext | None = None, *,
                 block_locks: blocklocks.BlockLocks = blocklocks.DEFAULT,
                 on_serving_change: Callable[[bool], None] | None = None) -> None:
        self._tls = tls
        self._registry = registry
        self._secret_for = secret_for
        self._block_locks = block_locks
        self.on_serving_change = on_serving_change
        self.serving = False
        self._listener = socket.create_server((host, port), family=_family(host), backlog=128, reuse_port=False)
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._handshaking: dict[_Conn, float] = {}  # -> handshake deadline; insertion order = oldest first
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kvbroker-tcp-accept", daemon=True)

    def start(self) -> None:
        self._set_serving(True)
        self._thread.start()

    def close(self) -> None:
        """Stops accepting and ends every connection. `serving` turns False without a callback: we are stopping."""
        self._stop.set()
        self.serving = False
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._listener.close()
        with self._lock:
            conns = [*self._conns, *self._handshaking]
        for c in conns:
            _shut(c.sock)

    def _set_serving(self, serving: bool) -> None:
        if self.serving == serving:
            return
        self.serving = serving
        if self.on_serving_change is not None:
            try:
                self.on_serving_change(serving)
            except Exception:
                log.exception("the data plane's health callback failed")

    # -- accepting ------------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        """Runs until close(): no error ends it (a lack of file descriptors or memory is usually transient)."""
        backoff = 0.0
        while not self._stop.is_set():
            try:
                backoff = self._accept_one(backoff)
            except Exception as e:  # a bug or an odd resource error: say so, keep the port alive
                log.exception("the data port's accept loop failed")
                backoff = self._back_off(OSError(errno.EIO, f"{type(e).__name__}: {e}"), backoff)

    def _accept_one(self, backoff: float) -> float:
        """Accepts one connection (or waits a poll interval); returns the back-off to use next."""
        self._expire_handshakes()
        try:
            conn, _ = self._listener.accept()
        except TimeoutError:
            return self._recovered() if backoff and _fds_available() else backoff
        except OSError as e:
            if self._stop.is_set() or e.errno in _CONNECTION_ERRNOS:
                return backoff
            return self._back_off(e, backoff)
        if backoff:
            backoff = self._recovered()
        if not self._start(conn):
            return self._back_off(OSError(errno.EAGAIN, "cannot start a connection thread"), backoff)
        return backoff

    def _back_off(self, error: OSError, backoff: float) -> float:
        if not backoff:  # once per episode
            log.warning("the data port %d cannot accept connections (%s); retrying with back-off until it can",
                        self.port, error)
            self._set_serving(False)
        backoff = min(_BACKOFF_MAX_S, max(_BACKOFF_MIN_S, backoff * 2))
        self._stop.wait(backoff)
        return backoff

    def _recovered(self) -> float:
        log.warning("the data port %d accepts connections again", self.port)
        self._set_serving(True)
        return 0.0

    def _start(self, sock: socket.socket) -> bool:
        conn = _Conn(sock)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        with self._lock:
            # A flood of slow or silent connections must not lock peers out: the oldest pending one gives way.
            oldest = next(iter(self._handshaking)) if len(self._handshaking) >= MAX_HANDSHAKES else None
            if oldest is not None:
                del self._handshaking[oldest]
            self._handshaking[conn] = deadline
        if oldest is not None:
            _shut(oldest.sock)
        try:
            threading.Thread(target=self._serve, args=(conn, deadline), name="kvbroker-tcp-serve",
                             daemon=True).start()
        except RuntimeError:  # no thread to be had (a resource limit): shed this connection
            with self._lock:
                self._handshaking.pop(conn, None)
            sock.close()
            return False
        return True

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            for conn, deadline in self._handshaking.items():
                if deadline > now:
                    break
                expired.append(conn)
            for conn in expired:
                del self._handshaking[conn]
        for conn in expired:
            _shut(conn.sock)

    # -- one connection -------------------------------------------------------------------------------------------
    def _serve(self, conn: _Conn, deadline: float) -> None:
        try:
            version = self._handshake(conn, deadline)
            if version is None:
                return  # A stranger gets nothing, not even an error message.
            with self._lock:
                if self._handshaking.pop(conn, None) is None:
                    return  # it ran out of time, or gave way to newer connections
                if len(self._conns) >= MAX_CONNECTIONS:
                    log.warning("refused a data connection: %d are open already", MAX_CONNECTIONS)
                    return
                self._conns.add(conn)
            sockio.send_all(conn.sock, b"KVOK", sockio.Watch(deadline))
            while not self._stop.is_set() and self._serve_request(conn.sock, version):
                pass
        except (ConnectionError, OSError, struct.error):
            pass
        except Exception:
            log.exception("data connection failed")
        finally:
            with self._lock:
                self._handshaking.pop(conn, None)
                self._conns.discard(conn)
            conn.sock.close()

    def _handshake(self, conn: _Conn, deadline: float) -> int | None:
        """The connection's protocol version once it proved its link, else None."""
        watch = sockio.Watch(deadline)
        _tune(conn.sock)
        if self._tls is not None:
            conn.sock.settimeout(watch.timeout(final=True))
            conn.sock = self._tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            conn.sock.do_handshake()
        nonce = linkauth.new_nonce()
        sockio.send_all(conn.sock, b"KVCH" + nonce, watch)
        magic, version, _, lid, mac = HELLO.unpack(sockio.recv_bytes(conn.sock, HELLO.size, watch))
        secret = self._secret_for(lid) if magic == b"KVHI" and version in _SERVED_VERSIONS else None
        if secret is None or not linkauth.verify(secret, nonce, lid, mac):
            log.warning("refused a data connection from %s: no valid link proof", _peer_name(conn.sock))
            return None
        return int(version)

    def _read_request(self, conn: socket.socket, version: int) -> tuple[bytes, int, float, np.ndarray] | None:
        """(magic, cache id, seconds the request may take, runs), or None when the peer closed or idled out."""
        head = REQUEST if version >= 2 else _REQUEST_V1
        buf = bytearray(head.size)
        conn.settimeout(IDLE_TIMEOUT_S)
        try:
            got = conn.recv_into(buf)
        except TimeoutError:
            return None
        if got == 0:
            return None
        watch = sockio.Watch(time.monotonic() + REQUEST_TIMEOUT_S)
        sockio.recv_exact(conn, memoryview(buf)[got:], watch)
        magic, count, cache_id, *rest = head.unpack(buf)
        if magic not in (b"KVRQ", b"KVWR") or not 0 < count <= MAX_RUNS_PER_REQUEST:
            raise ConnectionError("bad request frame")
        runs = np.frombuffer(sockio.recv_bytes(conn, count * RUN.itemsize, watch), dtype=RUN)
        budget = min(rest[0] / 1e3, MAX_REQUEST_S) if rest and rest[0] else MAX_REQUEST_S
        return magic, cache_id, budget, runs

    def _serve_request(self, conn: socket.socket, version: int) -> bool:
        request = self._read_request(conn, version)
        if request is None:
            return False
        magic, cache_id, budget, runs = request
        deadline = time.monotonic() + budget
        claim = None
        try:
            _check_runs(runs, self._registry.get(cache_id))
            if magic == b"KVWR":
                # Taken before the pin: a write waiting for its turn must not hold up the cache's release.
                claim = self._claim(self._registry.get(cache_id), runs, deadline)
            with self._registry.pinned(cache_id) as entry:
                _check_before_tls(conn, entry)
                # The pin blocks the cache's release: a reader that stopped reading must not keep it for long.
                watch = sockio.Watch(deadline, STALL_TIMEOUT_S, lambda: _being_released(entry))
                if magic == b"KVRQ":
                    self._serve_read(conn, version, entry, runs, watch)
                else:
                    self._serve_write(conn, entry, runs, watch)
        except LlmError as e:  # raised only before the OK reply: the stream is still in step
            msg = e.message.encode()
            sockio.send_all(conn, REPLY.pack(b"KVRS", int(e.status), len(msg)) + msg, sockio.Watch(deadline))
        finally:
            if claim is not None:
                self._block_locks.release(claim)
        return True

    def _claim(self, entry: CacheEntry, runs: np.ndarray, deadline: float) -> blocklocks.Claim:
        """Waits (within the request's deadline) until no other write into `entry` covers these blocks."""
        desc = entry.desc
        cells = blocklocks.run_cells(runs["tensor"], runs["offset"], runs["length"], desc.block_nbytes,
                                     desc.num_blocks)
        return self._block_locks.claim(entry, desc.num_tensors, desc.num_blocks, cells, deadline,
                                       f"write of a peer into cache {entry.cache_id}")

    def _serve_read(self, conn: socket.socket, version: int, entry: CacheEntry, runs: np.ndarray,
                    watch: sockio.Watch) -> None:
        total = int(runs["length"].sum())
        reply = memoryview(REPLY.pack(b"KVRS", 0, total))
        trailer = [memoryview(TRAILER.pack(b"KVEN", 0, total))] if version >= 2 else []
        if trailer and entry.addresses and staging.worth_it(runs["length"]):
            self._serve_read_staged(conn, entry, runs, reply, total, watch)
            return
        views = _views(entry, runs)
        try:
            # The reply, the bytes and the trailer in one gather: a small read reaches the reader in one segment
            # and wakes it once.
            sockio.send_views(conn, [reply, *views, *trailer], watch)
        except sockio.MemoryFault as fault:
            if fault.done < len(reply):  # the reply is our memory and goes first: a fault leaves at most part of it
                sockio.send_all(conn, reply[fault.done :], watch)
            fault.done = max(0, fault.done - len(reply))
            log.warning("cache %d lost its memory while a peer read it (a segment shrank or vanished); the read "
                        "fails, the link stays", entry.cache_id)
            if not trailer:
                raise ConnectionError("version 1 cannot report a failed read") from None
            sockio.send_zeros(conn, total - fault.done, watch)
            sockio.send_all(conn, TRAILER.pack(b"KVEN", int(LlmStatus.LLM_KV_CACHE_NOT_EXIST), fault.done), watch)

    @staticmethod
    def _serve_read_staged(conn: socket.socket, entry: CacheEntry, runs: np.ndarray, reply: memoryview, total: int,
                           watch: sockio.Watch) -> None:
        """_serve_read for small runs: gathered a chunk at a time into the staging buffer, one send per chunk."""
        length = runs["length"].astype(np.uint64)
        sent = 0
        head: list[memoryview] = [reply]
        for first, last, at in staging.chunks(length):
            buf = staging.buffer()
            n = int(at[-1] + length[last - 1])
            try:
                memcopy.copy_runs(staging.address(buf) + at,
                                  _addresses(entry, runs["tensor"][first:last], runs["offset"][first:last]),
                                  length[first:last])
            except memcopy.RunFault as e:
                log.warning("cache %d lost its memory while a peer read it (a segment shrank or vanished); the read "
                            "fails, the link stays", entry.cache_id)
                good = int(at[e.run])  # the runs before the fault are the source's
                sockio.send_views(conn, [*head, buf.data[:good]], watch)
                sockio.send_zeros(conn, total - sent - good, watch)
                sockio.send_all(conn, TRAILER.pack(b"KVEN", int(LlmStatus.LLM_KV_CACHE_NOT_EXIST), sent + good),
                                watch)
                return
            done = last == len(length)
            tail = [memoryview(TRAILER.pack(b"KVEN", 0, total))] if done else []
            sockio.send_views(conn, [*head, buf.data[:n], *tail], watch)  # a small read: one segment
            head, sent = [], sent + n

    def _serve_write(self, conn: socket.socket, entry: CacheEntry, runs: np.ndarray, watch: sockio.Watch) -> None:
        total = int(runs["length"].sum())
        sockio.send_all(conn, REPLY.pack(b"KVRS", 0, total), watch)
        try:
            if entry.addresses and staging.worth_it(runs["length"]):
                _recv_staged(conn, entry, runs, watch)
            else:
                sockio.recv_views(conn, _views(entry, runs), _ignore, watch)
        except sockio.MemoryFault as fault:
            log.warning("cache %d lost its memory while a peer wrote into it (a segment shrank or vanished); the "
                        "write fails, the link stays", entry.cache_id)
            sockio.drain(conn, total - fault.done, watch)
            msg = _vanished(f"destination cache {entry.cache_id}", "the write").encode()
            sockio.send_all(conn, REPLY.pack(b"KVRS", int(LlmStatus.LLM_KV_CACHE_NOT_EXIST), len(msg)) + msg, watch)
            return
        sockio.send_all(conn, REPLY.pack(b"KVRS", 0, total), watch)


def _ignore(_: int) -> None:
    pass


def _recv_staged(conn: socket.socket, entry: CacheEntry, runs: np.ndarray, watch: sockio.Watch) -> None:
    """A WRITE's payload of small runs, a chunk at a time into the staging buffer, then into the cache in one copy.
    Raises MemoryFault (with the payload bytes read so far) if the cache's memory vanished."""
    length = runs["length"].astype(np.uint64)
    received = 0
    for first, last, at in staging.chunks(length):
        buf = staging.buffer()
        n = int(at[-1] + length[last - 1])
        sockio.recv_exact(conn, buf.data[:n], watch)
        received += n
        try:
            memcopy.copy_runs(_addresses(entry, runs["tensor"][first:last], runs["offset"][first:last]),
                              staging.address(buf) + at, length[first:last])
        except memcopy.RunFault:
            raise sockio.MemoryFault(received) from None


def _check_before_tls(sock: socket.socket, entry: CacheEntry) -> None:
    """TLS copies payloads in user space (OpenSSL), where a vanished page is SIGBUS, not EFAULT: re-check the
    cache's segments under its pin first (plain sockets let the kernel turn the fault into EFAULT)."""
    if isinstance(sock, ssl.SSLSocket) and not entry.daemon_owned:
        entry.check_intact()


def _being_released(entry: CacheEntry) -> str | None:
    return f"cache {entry.cache_id} is being released" if entry.closing else None


def _vanished(what: str, during: str) -> str:
    return (f"{what} lost its memory during {during} (its shared-memory segment shrank or was removed by the model "
            "server)")


def _views(entry: CacheEntry, runs: np.ndarray) -> list[memoryview]:
    return [entry.views[t][off : off + n] for t, off, n in
            zip(runs["tensor"].tolist(), runs["offset"].tolist(), runs["length"].tolist(), strict=True)]


def _check_runs(runs: np.ndarray, entry: CacheEntry) -> None:
    size = entry.desc.tensor_nbytes
    if int(runs["tensor"].max()) >= entry.desc.num_tensors:
        fail(LlmStatus.LLM_PARAM_INVALID, f"tensor index out of range (cache has {entry.desc.num_tensors})")
    length, offset = runs["length"], runs["offset"]
    if not (np.all(length > 0) and np.all(length <= size) and np.all(offset <= size - length)):
        fail(LlmStatus.LLM_PARAM_INVALID, f"byte range outside the cache's tensors of {size} bytes")


def _peer_name(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername())
    except OSError:
        return "?"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# -- pulling side -------------------------------------------------------------------------------------------------
_Op = Callable[[socket.socket, int, "CacheEntry", Pieces, Progress, float], None]


def _request_frame(magic: bytes, cache_id: int, tensor: np.ndarray, offset: np.ndarray, length: np.ndarray,
                   deadline: float) -> bytes:
    """A request for the runs (tensor[i], offset[i], length[i]) of the peer's cache."""
    frame = np.zeros(len(length), dtype=RUN)
    frame["tensor"], frame["offset"], frame["length"] = tensor, offset, length
    budget_ms = min(max(1, math.ceil((deadline - time.monotonic()) * 1e3)), 0xFFFFFFFF)
    return REQUEST.pack(magic, len(length), cache_id, budget_ms, 0) + frame.tobytes()


def _refused(status: int, message: bytes | bytearray, what: str) -> NoReturn:
    try:
        code = LlmStatus(status)
    except ValueError:
        code = LlmStatus.LLM_FAILED
    fail(code, f"peer refused the {what}: {message.decode(errors='replace')}")


def _expect_ok(sock: socket.socket, what: str, watch: sockio.Watch) -> None:
    magic, status, size = REPLY.unpack(sockio.recv_bytes(sock, REPLY.size, watch))
    if magic != b"KVRS":
        raise ConnectionError("bad reply frame")
    if status != 0:
        _refused(status, sockio.recv_bytes(sock, min(size, 1 << 16), watch), what)


def _check_trailer(trailer: bytes | bytearray, pieces: Pieces, progress: Progress, cache_id: int) -> None:
    """After a READ's payload: did every byte come from the source? Runs that did not are taken back from
    `progress` (the server padded them with zeros) and the read fails."""
    magic, status, valid = TRAILER.unpack(trailer)
    if magic != b"KVEN":
        raise ConnectionError("bad trailer frame")
    if status == 0:
        return
    bad = np.cumsum(pieces.length, dtype=np.uint64) > np.uint64(valid)
    progress.mark_runs(pieces.run[bad], -pieces.length[bad].astype(np.int64))
    try:
        code = LlmStatus(status)
    except ValueError:
        code = LlmStatus.LLM_FAILED
    fail(code, _vanished(f"the peer's cache {cache_id}", "the read") + f"; {valid} bytes of the payload were good",
         cache_id=cache_id)


def _addresses(entry: CacheEntry, tensor: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Raw addresses of runs of a mapped cache (its pin keeps them valid)."""
    at: np.ndarray = np.asarray(entry.addresses, dtype=np.uint64)[tensor] + offset
    return at


def _read_staged(sock: socket.socket, dst: CacheEntry, pieces: Pieces, progress: Progress,
                 watch: sockio.Watch) -> None:
    """A READ's payload of small runs: a chunk at a time into the staging buffer, then into the cache in one copy."""
    for first, last, at in staging.chunks(pieces.length):
        buf = staging.buffer()
        n = int(at[-1] + pieces.length[last - 1])
        sockio.recv_exact(sock, buf.data[:n], watch)
        try:
            memcopy.copy_runs(_addresses(dst, pieces.dst_tensor[first:last], pieces.dst_offset[first:last]),
                              staging.address(buf) + at, pieces.length[first:last])
        except memcopy.RunFault as e:
            progress.mark_runs(pieces.run[first : first + e.run], pieces.length[first : first + e.run])
            _local_memory_gone(dst, "a pull")
        progress.mark_runs(pieces.run[first:last], pieces.length[first:last])


def _local_memory_gone(entry: CacheEntry, during: str) -> NoReturn:
    fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, _vanished(f"local cache {entry.cache_id}", during),
         cache_id=entry.cache_id)


def _shut_down(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


async def _recv_exact_on_loop(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        got = await loop.sock_recv_into(sock, view[pos:])
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        pos += got


class TcpChannel(PeerChannel):
    """A pool of authenticated data connections to one peer."""

    name = NAME

    def __init__(self, host: str, port: int, secret: bytes, executor: concurrent.futures.Executor,
                 max_connections: int = 4, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._addr = (host, port)
        self._secret = secret
        self._link_id = linkauth.link_id(secret)
        self._executor = executor
        self._max = max_connections
        self.parallel_transfers = max_connections
        self._reserved = 0  # connections that running transfers have claimed (under _lock)
        # Idle connections with the time they were last used (the server ends idle ones after IDLE_TIMEOUT_S).
        self._idle: list[tuple[socket.socket, float]] = []
        self._loop_idle: list[tuple[socket.socket, float]] = []  # non-blocking ones, used from the event loop
        self._lock = threading.Lock()
        self._closed = False

    # -- small pulls on the event loop --------------------------------------------------------------------------------
    def runs_on_loop(self, plan: Plan) -> bool:
        """A small pull costs less on the event loop (non-blocking socket, no thread hand-off) than in a worker."""
        return self._tls is None and plan.total_bytes <= _LOOP_MAX_BYTES and plan.num_runs <= _LOOP_MAX_RUNS

    async def pull_on_loop(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress,
                           deadline: float) -> int:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                sock = _fresh(self._loop_idle) or await self._connect_on_loop(loop)
                ok = False
                try:
                    pieces = Pieces.of(plan)
                    frame = _request_frame(b"KVRQ", remote.cache_id, plan.src_tensor, plan.src_offset, plan.length,
                                           deadline)
                    await loop.sock_sendall(sock, frame)
                    await self._expect_ok_on_loop(loop, sock)
                    for idx, _, _, dt, do, n in pieces.runs():
                        try:
                            await _recv_exact_on_loop(loop, sock, dst.views[dt][do : do + n])
                        except OSError as e:
                            if e.errno == errno.EFAULT:
                                _local_memory_gone(dst, "a pull")
                            raise
                        progress.mark(idx, n)
                    trailer = bytearray(TRAILER.size)
                    await _recv_exact_on_loop(loop, sock, memoryview(trailer))
                    _check_trailer(trailer, pieces, progress, remote.cache_id)
                    ok = True
                finally:
                    if ok and not self._closed and len(self._loop_idle) < self._max:
                        self._loop_idle.append((sock, time.monotonic()))
                    else:
                        sock.close()
        except TimeoutError:
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed while receiving blocks over tcp")
        except (OSError, ConnectionError) as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"data connection to {self._addr} failed: {e}")
        return plan.total_bytes

    async def _connect_on_loop(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        sock = socket.socket(_family(self._addr[0]), socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            _tune(sock)
            await loop.sock_connect(sock, self._addr)
            challenge = bytearray(4 + linkauth.NONCE_BYTES)
            await _recv_exact_on_loop(loop, sock, memoryview(challenge))
            if challenge[:4] != b"KVCH":
                raise ConnectionError("unexpected data-port greeting")
            mac = linkauth.proof(self._secret, bytes(challenge[4:]), self._link_id)
            await loop.sock_sendall(sock, HELLO.pack(b"KVHI", VERSION, 0, self._link_id, mac))
            answer = bytearray(4)
            await _recv_exact_on_loop(loop, sock, memoryview(answer))
            if answer != b"KVOK":
                raise ConnectionError("the peer refused the data connection")
        except BaseException:
            sock.close()
            raise
        return sock

    async def _expect_ok_on_loop(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        head = bytearray(REPLY.size)
        await _recv_exact_on_loop(loop, sock, memoryview(head))
        magic, status, size = REPLY.unpack(head)
        if magic != b"KVRS":
            raise ConnectionError("bad reply frame")
        if status != 0:
            message = bytearray(min(size, 1 << 16))
            await _recv_exact_on_loop(loop, sock, memoryview(message))
            _refused(status, message, "read")

    # -- everything else on worker threads ----------------------------------------------------------------------------
    def _connect(self, deadline: float) -> socket.socket:
        watch = sockio.Watch(deadline)
        try:
            sock = socket.create_connection(self._addr, timeout=watch.timeout())
        except TimeoutError:
            fail(LlmStatus.LLM_TIMEOUT, f"connecting to the peer's data port {self._addr} timed out")
        except OSError as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"cannot connect to the peer's data port {self._addr}: {e}")
        try:
            _tune(sock)
            if self._tls is not None:
                sock.settimeout(watch.timeout(final=True))
                sock = self._tls.wrap_socket(sock, server_hostname=self._addr[0])
            challenge = sockio.recv_bytes(sock, 4 + linkauth.NONCE_BYTES, watch)
            if challenge[:4] != b"KVCH":
                raise ConnectionError("unexpected data-port greeting")
            mac = linkauth.proof(self._secret, challenge[4:], self._link_id)
            sockio.send_all(sock, HELLO.pack(b"KVHI", VERSION, 0, self._link_id, mac), watch)
            if sockio.recv_bytes(sock, 4, watch) != b"KVOK":
                raise ConnectionError("unexpected handshake answer")
        except TimeoutError:
            sock.close()
            fail(LlmStatus.LLM_TIMEOUT, f"the peer's data port {self._addr} did not answer in time")
        except (OSError, ConnectionError) as e:
            sock.close()
            fail(LlmStatus.LLM_LINK_FAILED, f"the peer refused the data connection: {e}")
        return sock

    def _acquire(self, deadline: float) -> socket.socket:
        with self._lock:
            if self._closed:
                fail(LlmStatus.LLM_NOT_YET_LINK, "the link was closed")
            sock = _fresh(self._idle)
        return sock or self._connect(deadline)

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(self._read, remote.cache_id, dst, plan, progress, deadline)

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(self._write, remote.cache_id, src, plan, progress, deadline)

    def _run(self, op: _Op, cache_id: int, local: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        """Spreads a large plan over the pool's free connections and waits for every part. Concurrent transfers
        take one connection each rather than all of them: more connections than the pool holds would each cost a
        new connection and handshake, and add no bandwidth."""
        with self._lock:
            free = self._max - self._reserved
            parts = 1 if plan.total_bytes < _SPLIT_MIN_BYTES else max(1, min(free, plan.num_runs))
            self._reserved += parts
        try:
            run_parts(self._executor,
                      lambda part: self._on_connection(op, cache_id, local, part, progress, deadline),
                      Pieces.of(plan).split(parts))
        finally:
            with self._lock:
                self._reserved -= parts
        return plan.total_bytes

    def _on_connection(self, op: _Op, cache_id: int, local: CacheEntry, pieces: Pieces, progress: Progress,
                       deadline: float) -> None:
        sock = self._acquire(deadline)
        ok = False
        try:
            with progress.on_cancel(lambda: _shut_down(sock)):  # wakes this thread if it waits on the socket
                for i in range(0, len(pieces), MAX_RUNS_PER_REQUEST):
                    op(sock, cache_id, local, pieces.take(slice(i, i + MAX_RUNS_PER_REQUEST)), progress, deadline)
                ok = not progress.cancelled
        except (OSError, ConnectionError) as e:
            if progress.cancelled:  # we shut the socket down ourselves: the link is fine
                fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
            if isinstance(e, TimeoutError):
                fail(LlmStatus.LLM_TIMEOUT, "deadline passed while moving blocks over tcp")
            fail(LlmStatus.LLM_LINK_FAILED, f"data connection to {self._addr} failed: {e}")
        finally:
            if ok:
                self._release(sock)
            else:
                sock.close()  # Its stream position is unknown now; never reuse it.

    def _read(self, sock: socket.socket, cache_id: int, dst: CacheEntry, pieces: Pieces, progress: Progress,
              deadline: float) -> None:
        """READ: the peer sends the runs' source bytes; they land in the destination cache, straight from the socket
        or, when all runs are small, through the staging buffer."""
        _check_before_tls(sock, dst)
        watch = sockio.Watch(deadline)
        sockio.send_all(sock, _request_frame(b"KVRQ", cache_id, pieces.src_tensor, pieces.src_offset, pieces.length,
                                             deadline), watch)
        _expect_ok(sock, "read", watch)
        if staging.worth_it(pieces.length) and dst.addresses:
            _read_staged(sock, dst, pieces, progress, watch)
        else:
            views = [dst.views[dt][do : do + n] for _, _, _, dt, do, n in pieces.runs()]
            last = len(views)

            def landed(k: int) -> None:
                if k < last:
                    progress.mark(int(pieces.run[k]), int(pieces.length[k]))

            try:
                sockio.recv_views(sock, views, landed, watch)
            except sockio.MemoryFault:
                _local_memory_gone(dst, "a pull")
        trailer = bytearray(TRAILER.size)
        sockio.recv_exact(sock, memoryview(trailer), watch)
        _check_trailer(trailer, pieces, progress, cache_id)

    def _write(self, sock: socket.socket, cache_id: int, src: CacheEntry, pieces: Pieces, progress: Progress,
               deadline: float) -> None:
        """WRITE: the peer checks the destination runs first, then receives the bytes into its cache and acks."""
        _check_before_tls(sock, src)
        watch = sockio.Watch(deadline)
        sockio.send_all(sock, _request_frame(b"KVWR", cache_id, pieces.dst_tensor, pieces.dst_offset, pieces.length,
                                             deadline), watch)
        _expect_ok(sock, "write", watch)
        try:
            if staging.worth_it(pieces.length) and src.addresses:
                for first, last, at in staging.chunks(pieces.length):
                    buf = staging.buffer()
                    n = int(at[-1] + pieces.length[last - 1])
                    try:
                        memcopy.copy_runs(staging.address(buf) + at, _addresses(src, pieces.src_tensor[first:last],
                                                                                pieces.src_offset[first:last]),
                                          pieces.length[first:last])
                    except memcopy.RunFault:
                        _local_memory_gone(src, "a push")  # the connection closes mid-payload: the peer drops it
                    sockio.send_all(sock, buf.data[:n], watch)
            else:
                sockio.send_views(sock, [src.views[st][so : so + n] for _, st, so, _, _, n in pieces.runs()], watch)
        except sockio.MemoryFault:
            _local_memory_gone(src, "a push")  # the connection closes mid-payload: the peer drops what it got
        _expect_ok(sock, "write", watch)
        progress.mark_runs(pieces.run, pieces.length)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s, _ in idle + self._loop_idle:
            s.close()
        self._loop_idle = []


def _fresh(pool: list[tuple[socket.socket, float]]) -> socket.socket | None:
    """The most recently used pooled connection that the server has not retired yet; closes older ones."""
    while pool:
        sock, used = pool.pop()
        if time.monotonic() - used < _POOL_IDLE_S:
            return sock
        sock.close()
    return None


class TcpBackend(Backend):
    """Serves this daemon's caches on its data port and advertises the port; peers dial the host they reached our
    peer API on (an advertisement never names a host)."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, ctx: LocalContext) -> None:
        super().__init__(ctx)
        self.server: DataServer | None = None

    async def start(self) -> None:
        self.server = DataServer(self.ctx.registry, self.ctx.secret_for, self.ctx.peer_host, self.ctx.data_port,
                                 tls=self.ctx.data_server_tls)
        self.server.start()

    @property
    def serving(self) -> bool:
        return self.server is not None and self.server.serving

    @property
    def port(self) -> int:
        return 0 if self.server is None else self.server.port

    def advertise(self) -> bytes:
        return json.dumps({"port": self.port}).encode()

    def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            port = json.loads(info)["port"]
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable tcp advertisement ({type(e).__name__})") from None
        if type(port) is not int or not 0 < port < 65536:
            raise BackendUnusable(f"invalid tcp data port {str(port)[:20]!r}")
        host = peer.peer_address.rpartition(":")[0].strip("[]")
        return TcpChannel(host, port, peer.secret, self.ctx.parts_executor, tls=self.ctx.data_client_tls)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


BACKEND = TcpBackend
