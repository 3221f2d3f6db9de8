"""`tcp` backend: the cross-host path over the daemons' own data sockets (not gRPC).

Wire format (little endian), one connection = one authenticated link, requests answered in order:

    CHALLENGE server -> client magic "KVCH", 32-byte random nonce
    HELLO   client -> server   magic "KVHI", u16 version, u16 reserved, 16-byte link id,
                               32-byte HMAC-SHA256(link secret, label || nonce || link id)   (see linkauth.py)
    READY   server -> client   magic "KVOK"                     (or the connection is closed: a stranger gets nothing)
    READ    client -> server   magic "KVRQ", u32 run count, i64 cache id, then per run:
                               u32 tensor, u32 reserved, u64 offset, u64 length
    REPLY   server -> client   magic "KVRS", u32 LLM status, u64 payload bytes,
                               then the payload (every run's bytes in request order) or, on error, the message
    WRITE   client -> server   magic "KVWR", then as READ (runs name the server's destination bytes)
            server -> client   REPLY with no payload (or the error), then, if it was OK:
            client -> server   the payload;  server -> client  REPLY again once every byte is in its cache

The server validates a whole request against its registry before a byte moves, and pins the cache meanwhile;
runs travel as scatter/gather lists (sendmsg / recvmsg_into) straight between the caches' memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvbroker._status import LlmError
from kvbrokerd import linkauth
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
from kvbrokerd.planner import Progress, Run, split_runs

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan
    from kvbrokerd.registry import CacheEntry, Registry

log = logging.getLogger(__name__)

NAME = "tcp"
CAPABILITIES = Capabilities(same_host_only=False, one_sided_read=False)
VERSION = 1
HELLO = struct.Struct(f"<4sHH{linkauth.ID_BYTES}s{linkauth.MAC_BYTES}s")
REQUEST = struct.Struct("<4sIq")
REPLY = struct.Struct("<4sIQ")
RUN = np.dtype([("tensor", "<u4"), ("reserved", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_RUNS_PER_REQUEST = 1 << 16
HANDSHAKE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 512
# A writer that stops sending mid-payload must not pin our cache forever.
WRITE_TIMEOUT_S = 60.0
SOCKET_BUFFER_BYTES = 4 << 20
# Pulls smaller than this use one connection; larger ones are spread over the pool.
_SPLIT_MIN_BYTES = 4 << 20
# Pulls at most this big run on the event loop (see TcpChannel.runs_on_loop).
_LOOP_MAX_BYTES = 1 << 20
_LOOP_MAX_RUNS = 64


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos, end = 0, len(view)
    while pos < end:
        got = sock.recv_into(view[pos:], end - pos)
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        pos += got


IOV_BATCH = 512
"""Buffers per sendmsg/recvmsg_into call: one system call moves many small runs (Linux allows 1024)."""


def _advance(views: list[memoryview], i: int, done: int) -> tuple[int, int, list[int]]:
    """After `done` more bytes of views[i:], returns (new i, bytes into views[i], indices of views completed)."""
    completed = []
    while done and done >= len(views[i]):
        done -= len(views[i])
        completed.append(i)
        i += 1
    if done:
        views[i] = views[i][done:]
    return i, done, completed


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    if isinstance(sock, ssl.SSLSocket):  # TLS has no scatter/gather: one record stream, view by view
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + IOV_BATCH])
        i, _, _ = _advance(views, i, sent)


def _recv_views(sock: socket.socket, views: list[memoryview], on_complete: Callable[[int], None],
                deadline: float) -> None:
    """Fills `views` in order straight from the socket before `deadline`; calls on_complete(index) as each fills."""
    if isinstance(sock, ssl.SSLSocket):
        for k, v in enumerate(views):
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            _recv_exact(sock, v)
            on_complete(k)
        return
    i = 0
    while i < len(views):
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        got = sock.recvmsg_into(views[i : i + IOV_BATCH])[0]
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        i, _, completed = _advance(views, i, got)
        for k in completed:
            on_complete(k)


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


# -- serving side -------------------------------------------------------------------------------------------------
class DataServer:
    """Accepts data connections from linked peers and serves reads of registered caches (thread per connection)."""

    def __init__(self, registry: Registry, secret_for: Callable[[bytes], bytes | None], host: str,
                 port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._registry = registry
        self._secret_for = secret_for
        self._listener = socket.create_server((host, port), family=_family(host), backlog=128, reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvbroker-tcp-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvbroker-tcp-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raw = conn
        with self._lock:
            if len(self._conns) >= MAX_CONNECTIONS:
                conn.close()
                log.warning("refused a data connection: %d are open already", MAX_CONNECTIONS)
                return
            self._conns.add(raw)
        try:
            _tune(conn)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            nonce = linkauth.new_nonce()
            conn.sendall(b"KVCH" + nonce)
            magic, version, _, lid, mac = HELLO.unpack(_recv_bytes(conn, HELLO.size))
            secret = self._secret_for(lid) if magic == b"KVHI" and version == VERSION else None
            if secret is None or not linkauth.verify(secret, nonce, lid, mac):
                log.warning("refused a data connection from %s: no valid link proof", _peer_name(conn))
                return  # A stranger gets nothing, not even an error message.
            conn.sendall(b"KVOK")
            conn.settimeout(None)
            while not self._closed:
                self._serve_request(conn)
        except (ConnectionError, OSError, struct.error):
            pass
        except Exception:
            log.exception("data connection failed")
        finally:
            with self._lock:
                self._conns.discard(raw)
            conn.close()

    def _serve_request(self, conn: socket.socket) -> None:
        magic, count, cache_id = REQUEST.unpack(_recv_bytes(conn, REQUEST.size))
        if magic not in (b"KVRQ", b"KVWR") or not 0 < count <= MAX_RUNS_PER_REQUEST:
            raise ConnectionError("bad request frame")
        runs = np.frombuffer(_recv_bytes(conn, count * RUN.itemsize), dtype=RUN)
        try:
            with self._registry.pinned(cache_id) as entry:
                _check_runs(runs, entry)
                views = [entry.views[t][off : off + n] for t, off, n in
                         zip(runs["tensor"].tolist(), runs["offset"].tolist(), runs["length"].tolist(), strict=True)]
                total = int(runs["length"].sum())
                conn.sendall(REPLY.pack(b"KVRS", 0, total))
                if magic == b"KVRQ":
                    _send_views(conn, views)
                else:
                    _recv_views(conn, views, lambda _: None, time.monotonic() + WRITE_TIMEOUT_S)
                    conn.settimeout(None)
                    conn.sendall(REPLY.pack(b"KVRS", 0, total))
        except LlmError as e:
            msg = e.message.encode()
            conn.sendall(REPLY.pack(b"KVRS", int(e.status), len(msg)) + msg)


_Op = Callable[[socket.socket, int, "CacheEntry", list[Run], Progress, float], None]


def _request_frame(magic: bytes, cache_id: int, runs: list[tuple[int, int, int]]) -> bytes:
    frame = np.zeros(len(runs), dtype=RUN)
    frame["tensor"], frame["offset"], frame["length"] = zip(*runs, strict=True)
    return REQUEST.pack(magic, len(runs), cache_id) + frame.tobytes()


def _send_request(sock: socket.socket, magic: bytes, cache_id: int, runs: list[tuple[int, int, int]],
                  deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(_request_frame(magic, cache_id, runs))


async def _recv_exact_on_loop(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        got = await loop.sock_recv_into(sock, view[pos:])
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        pos += got


def _expect_ok(sock: socket.socket, what: str) -> None:
    magic, status, size = REPLY.unpack(_recv_bytes(sock, REPLY.size))
    if magic != b"KVRS":
        raise ConnectionError("bad reply frame")
    if status != 0:
        message = _recv_bytes(sock, min(size, 1 << 16)).decode(errors="replace")
        try:
            code = LlmStatus(status)
        except ValueError:
            code = LlmStatus.LLM_FAILED
        fail(code, f"peer refused the {what}: {message}")


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
        self._idle: list[socket.socket] = []
        self._loop_idle: list[socket.socket] = []  # non-blocking connections used from the event loop
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
                sock = self._loop_idle.pop() if self._loop_idle else await self._connect_on_loop(loop)
                ok = False
                try:
                    runs = plan.runs()
                    frame = _request_frame(b"KVRQ", remote.cache_id, [(r[1], r[2], r[5]) for r in runs])
                    await loop.sock_sendall(sock, frame)
                    await self._expect_ok_on_loop(loop, sock)
                    for idx, _, _, dt, do, n in runs:
                        await _recv_exact_on_loop(loop, sock, dst.views[dt][do : do + n])
                        progress.mark(idx, n)
                    ok = True
                finally:
                    if ok and not self._closed and len(self._loop_idle) < self._max:
                        self._loop_idle.append(sock)
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
            try:
                code = LlmStatus(status)
            except ValueError:
                code = LlmStatus.LLM_FAILED
            fail(code, f"peer refused the read: {message.decode(errors='replace')}")

    # -- everything else on worker threads ----------------------------------------------------------------------------
    def _connect(self, deadline: float) -> socket.socket:
        timeout = max(0.001, deadline - time.monotonic())
        try:
            sock = socket.create_connection(self._addr, timeout=timeout)
        except TimeoutError:
            fail(LlmStatus.LLM_TIMEOUT, f"connecting to the peer's data port {self._addr} timed out")
        except OSError as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"cannot connect to the peer's data port {self._addr}: {e}")
        try:
            _tune(sock)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._addr[0])
            challenge = _recv_bytes(sock, 4 + linkauth.NONCE_BYTES)
            if challenge[:4] != b"KVCH":
                raise ConnectionError("unexpected data-port greeting")
            mac = linkauth.proof(self._secret, challenge[4:], self._link_id)
            sock.sendall(HELLO.pack(b"KVHI", VERSION, 0, self._link_id, mac))
            if _recv_bytes(sock, 4) != b"KVOK":
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
            if self._idle:
                return self._idle.pop()
        return self._connect(deadline)

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max:
                self._idle.append(sock)
                return
        sock.close()

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(self._read, remote.cache_id, dst, plan, progress, deadline)

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(self._write, remote.cache_id, src, plan, progress, deadline)

    def _run(self, op: _Op, cache_id: int, local: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        """Spreads the plan over the pool's connections (large plans only) and waits for every part."""
        parts = 1 if plan.total_bytes < _SPLIT_MIN_BYTES else min(self._max, plan.num_runs)
        run_parts(self._executor, lambda runs: self._on_connection(op, cache_id, local, runs, progress, deadline),
                  split_runs(plan.runs(), parts))
        return plan.total_bytes

    def _on_connection(self, op: _Op, cache_id: int, local: CacheEntry, runs: list[Run], progress: Progress,
                       deadline: float) -> None:
        sock = self._acquire(deadline)
        progress.attach(sock)
        ok = False
        try:
            for i in range(0, len(runs), MAX_RUNS_PER_REQUEST):
                op(sock, cache_id, local, runs[i : i + MAX_RUNS_PER_REQUEST], progress, deadline)
            ok = not progress.cancelled
        except (OSError, ConnectionError) as e:
            if progress.cancelled:  # we shut the socket down ourselves: the link is fine
                fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
            if isinstance(e, TimeoutError):
                fail(LlmStatus.LLM_TIMEOUT, "deadline passed while moving blocks over tcp")
            fail(LlmStatus.LLM_LINK_FAILED, f"data connection to {self._addr} failed: {e}")
        finally:
            progress.detach(sock)
            if ok:
                self._release(sock)
            else:
                sock.close()  # Its stream position is unknown now; never reuse it.

    def _read(self, sock: socket.socket, cache_id: int, dst: CacheEntry, runs: list[Run], progress: Progress,
              deadline: float) -> None:
        """READ: the peer sends the runs' source bytes; they land straight in the destination cache."""
        _send_request(sock, b"KVRQ", cache_id, [(r[1], r[2], r[5]) for r in runs], deadline)
        _expect_ok(sock, "read")
        views = [dst.views[dt][do : do + n] for _, _, _, dt, do, n in runs]
        _recv_views(sock, views, lambda k: progress.mark(runs[k][0], runs[k][5]), deadline)

    def _write(self, sock: socket.socket, cache_id: int, src: CacheEntry, runs: list[Run], progress: Progress,
               deadline: float) -> None:
        """WRITE: the peer checks the destination runs first, then receives the bytes into its cache and acks."""
        _send_request(sock, b"KVWR", cache_id, [(r[3], r[4], r[5]) for r in runs], deadline)
        _expect_ok(sock, "write")
        _send_views(sock, [src.views[st][so : so + n] for _, st, so, _, _, n in runs])
        _expect_ok(sock, "write")
        for idx, *_, n in runs:
            progress.mark(idx, n)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle + self._loop_idle:
            s.close()
        self._loop_idle = []


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
        return self.server is not None and bool(getattr(self.server, "serving", True))

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
