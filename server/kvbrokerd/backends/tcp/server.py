"""The tcp data server: serves this daemon's caches to authenticated peers on the data port (the wire format is
in wire.py). The server validates a whole request against its registry before a byte moves, and pins the cache
meanwhile; runs travel as scatter/gather lists (sendmsg / recvmsg_into) straight between the caches' memory.
Nothing waits without a bound: a handshake has one total deadline and the oldest pending one gives way when
MAX_HANDSHAKES are under way; a request's frame must arrive within REQUEST_TIMEOUT_S of its first byte; its payload
moves within the sender's deadline (at most MAX_REQUEST_S), gives up after STALL_TIMEOUT_S without progress, below
the minimum rate (`--tcp-min-rate` bytes/s over each `--tcp-rate-window-s`: a peer that reads or writes a trickle
would otherwise pin the cache until its deadline) and, once its cache is being released, as soon as the other side
stops taking bytes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbroker.status import LlmError
from kvbrokerd.backends.common import memcopy, sockio, staging
from kvbrokerd.backends.tcp import native
from kvbrokerd.backends.tcp.wire import (
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_LINK,
    MAX_HANDSHAKES,
    MAX_REQUEST_S,
    MAX_RUNS_PER_REQUEST,
    MIN_RATE_BYTES_PER_S,
    RATE_WINDOW_S,
    REPLY,
    REQUEST,
    REQUEST_TIMEOUT_S,
    RUN,
    STALL_TIMEOUT_S,
    TRAILER,
    addresses,
    check_before_tls,
    family,
    shut_down,
    tune,
    vanished,
)
from kvbrokerd.dataplane import blocklocks
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.links import linkauth

if TYPE_CHECKING:
    from kvbrokerd.registry.caches import CacheEntry, Registry


log = logging.getLogger(__name__)

_SERVED_VERSIONS = (1, 2)
_REQUEST_V1 = struct.Struct("<4sIq")
DEFAULT_MIN_RATE = sockio.MinRate(MIN_RATE_BYTES_PER_S, RATE_WINDOW_S)

# The accept loop wakes this often to end handshakes past their deadline.
_ACCEPT_POLL_S = 0.25
_BACKOFF_MIN_S = 0.01
_BACKOFF_MAX_S = 1.0
# accept(2) errors that concern only the connection being accepted: the next accept is fine.
_CONNECTION_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.ENOPROTOOPT,
                                errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH,
                                errno.EINTR, errno.EAGAIN})



def _fds_available() -> bool:
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return False
    return True



@dataclass(eq=False)
class _Conn:
    """A served connection; `sock` becomes the TLS socket once wrapped (shutting that down wakes its thread)."""

    sock: socket.socket
    link_id: bytes = b""  # the link it proved, once it did


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
                 on_serving_change: Callable[[bool], None] | None = None,
                 min_rate: sockio.MinRate = DEFAULT_MIN_RATE) -> None:
        """`min_rate`: a peer reading or writing a cache slower than this is abandoned (the pin it holds blocks
        the cache's release and its owner's lease expiry)."""
        self._tls = tls
        self._min_rate = min_rate
        self._registry = registry
        self._secret_for = secret_for
        self._block_locks = block_locks
        self.on_serving_change = on_serving_change
        self.serving = False
        # `::` (a peer API on [::]) serves IPv4 peers too, as gRPC's own listener on [::] does.
        self._listener = socket.create_server((host, port), family=family(host), backlog=128, reuse_port=False,
                                              dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._handshaking: dict[_Conn, float] = {}  # -> handshake deadline; insertion order = oldest first
        self._conns: set[_Conn] = set()
        self._per_link: dict[bytes, int] = {}  # authenticated connections open, by link id
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kvbroker-tcp-accept", daemon=True)
        # Plain connections' READs are served without Python where the C extension is there (native.py).
        self._native = native.NativeReads(registry, min_rate) if tls is None and native.available() else None

    def start(self) -> None:
        self._set_serving(True)
        self._thread.start()

    def close(self) -> None:
        """Stops accepting and ends every connection. `serving` turns False without a callback: we are stopping."""
        self._stop.set()
        self.serving = False
        if self._native is not None:
            self._native.stop()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._listener.close()
        with self._lock:
            conns = [*self._conns, *self._handshaking]
        for c in conns:
            shut_down(c.sock)

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
            shut_down(oldest.sock)
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
            shut_down(conn.sock)

    # -- one connection -------------------------------------------------------------------------------------------
    def _serve(self, conn: _Conn, deadline: float) -> None:
        try:
            version = self._handshake(conn, deadline)
            if version is None:
                return  # A stranger gets nothing, not even an error message.
            with self._lock:
                if self._handshaking.pop(conn, None) is None:
                    return  # it ran out of time, or gave way to newer connections
                if not self._admit(conn):
                    return
            sockio.send_all(conn.sock, b"KVOK", sockio.Watch(deadline))
            while not self._stop.is_set():
                pending = self._serve_natively(conn.sock, version)
                if pending is None or not self._serve_request(conn.sock, version, pending):
                    break
        except TimeoutError as e:  # a stalled or too slow peer: worth an operator's look (one line per connection)
            log.warning("dropped the data connection from %s: %s", _peer_name(conn.sock), e)
        except (ConnectionError, OSError, struct.error):
            pass
        except Exception:
            log.exception("data connection failed")
        finally:
            with self._lock:
                self._handshaking.pop(conn, None)
                if conn in self._conns:
                    self._conns.discard(conn)
                    self._per_link[conn.link_id] -= 1
                    if not self._per_link[conn.link_id]:
                        del self._per_link[conn.link_id]
            conn.sock.close()

    def _admit(self, conn: _Conn) -> bool:
        """Counts an authenticated connection against both caps (under _lock): a link holding its share is refused
        before the global cap is touched, so one peer cannot lock the others out."""
        held = self._per_link.get(conn.link_id, 0)
        if held >= MAX_CONNECTIONS_PER_LINK:
            log.warning("refused a data connection of link %s: it holds %d already (the most one link may)",
                        conn.link_id.hex()[:8], held)
            return False
        if len(self._conns) >= MAX_CONNECTIONS:
            log.warning("refused a data connection: %d are open already", MAX_CONNECTIONS)
            return False
        self._conns.add(conn)
        self._per_link[conn.link_id] = held + 1
        return True

    def _handshake(self, conn: _Conn, deadline: float) -> int | None:
        """The connection's protocol version once it proved its link, else None."""
        watch = sockio.Watch(deadline)
        tune(conn.sock)
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
        conn.link_id = bytes(lid)
        return int(version)

    def _serve_natively(self, conn: socket.socket, version: int) -> bytes | None:
        """Lets the C extension serve READs until one needs Python: that request's bytes read so far (b"" without
        the extension, on TLS or version 1), or None when the connection is done."""
        if self._native is None or version < 2 or isinstance(conn, ssl.SSLSocket):
            return b""
        while True:
            got = self._native.serve(conn)
            if not isinstance(got, int):
                return got
            log.warning("cache %d lost its memory while a peer read it (a segment shrank or vanished); the read "
                        "fails, the link stays", got)

    def _read_request(self, conn: socket.socket, version: int,
                      pending: bytes = b"") -> tuple[bytes, int, float, np.ndarray] | None:
        """(magic, cache id, seconds the request may take, runs), or None when the peer closed or idled out.
        `pending`: the request's leading bytes, already read (its head, perhaps its runs too)."""
        head = REQUEST if version >= 2 else _REQUEST_V1
        buf = bytearray(head.size)
        got = len(pending[: head.size])
        buf[:got] = pending[: head.size]
        if not got:
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
        frame = pending[head.size :]
        if len(frame) != count * RUN.itemsize:
            frame += sockio.recv_bytes(conn, count * RUN.itemsize - len(frame), watch)
        runs = np.frombuffer(frame, dtype=RUN)
        budget = min(rest[0] / 1e3, MAX_REQUEST_S) if rest and rest[0] else MAX_REQUEST_S
        return magic, cache_id, budget, runs

    def _serve_request(self, conn: socket.socket, version: int, pending: bytes = b"") -> bool:
        request = self._read_request(conn, version, pending)
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
                check_before_tls(conn, entry)
                # The pin blocks the cache's release: a reader that stopped reading must not keep it for long.
                watch = sockio.Watch(deadline, STALL_TIMEOUT_S, lambda: _being_released(entry), self._min_rate)
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
                                  addresses(entry, runs["tensor"][first:last], runs["offset"][first:last]),
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
            msg = vanished(f"destination cache {entry.cache_id}", "the write").encode()
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
            memcopy.copy_runs(addresses(entry, runs["tensor"][first:last], runs["offset"][first:last]),
                              staging.address(buf) + at, length[first:last])
        except memcopy.RunFault:
            raise sockio.MemoryFault(received) from None



def _being_released(entry: CacheEntry) -> str | None:
    return f"cache {entry.cache_id} is being released" if entry.closing else None




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


