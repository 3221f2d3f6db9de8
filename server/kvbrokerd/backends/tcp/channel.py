"""The tcp channel: the pulling (and pushing) side, a pool of authenticated data connections to one peer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from kvbrokerd.backends.common import memcopy, sockio, staging
from kvbrokerd.backends.common.parts import run_parts
from kvbrokerd.backends.tcp.wire import (
    HELLO,
    MAX_RUNS_PER_REQUEST,
    NAME,
    REPLY,
    REQUEST,
    RUN,
    TRAILER,
    VERSION,
    addresses,
    check_before_tls,
    family,
    shut_down,
    tune,
    vanished,
)
from kvbrokerd.dataplane.plan import Pieces, Progress
from kvbrokerd.dataplane.seam import (
    PeerChannel,
    RemoteCache,
)
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.links import linkauth

if TYPE_CHECKING:
    from kvbrokerd.dataplane.plan import Plan
    from kvbrokerd.registry.caches import CacheEntry


log = logging.getLogger(__name__)

# Pulls smaller than this use one connection; larger ones are spread over the pool.
_SPLIT_MIN_BYTES = 4 << 20
# Pulls at most this big run on the event loop (see TcpChannel.runs_on_loop).
_LOOP_MAX_BYTES = 1 << 20
_LOOP_MAX_RUNS = 64
# At most this many small pulls of one link on the event loop at once (each holds a connection); with the worker
# side's connections (parallel_transfers, each split over at most as many) well inside the server's per-link share.
_LOOP_MAX_CONNECTIONS = 16
# Views per recvmsg_into (the kernel's IOV_MAX).
_IOV_MAX = 1024
# A client retires a pooled connection idle for longer than this (well before the server's IDLE_TIMEOUT_S).
_POOL_IDLE_S = 60.0


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
    fail(code, vanished(f"the peer's cache {cache_id}", "the read") + f"; {valid} bytes of the payload were good",
         cache_id=cache_id)




def _read_staged(sock: socket.socket, dst: CacheEntry, pieces: Pieces, progress: Progress,
                 watch: sockio.Watch) -> None:
    """A READ's payload of small runs: a chunk at a time into the staging buffer, then into the cache in one copy."""
    for first, last, at in staging.chunks(pieces.length):
        buf = staging.buffer()
        n = int(at[-1] + pieces.length[last - 1])
        sockio.recv_exact(sock, buf.data[:n], watch)
        sockio.fence(watch.deadline)  # nothing that arrived late is written into the cache
        try:
            memcopy.copy_runs(addresses(dst, pieces.dst_tensor[first:last], pieces.dst_offset[first:last]),
                              staging.address(buf) + at, pieces.length[first:last])
        except memcopy.RunFault as e:
            progress.mark_runs(pieces.run[first : first + e.run], pieces.length[first : first + e.run])
            _local_memory_gone(dst, "a pull")
        progress.mark_runs(pieces.run[first:last], pieces.length[first:last])


def _local_memory_gone(entry: CacheEntry, during: str) -> NoReturn:
    fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, vanished(f"local cache {entry.cache_id}", during),
         cache_id=entry.cache_id)




async def _recv_exact_on_loop(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        got = await loop.sock_recv_into(sock, view[pos:])
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        pos += got


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _recv_views_on_loop(loop: asyncio.AbstractEventLoop, sock: socket.socket, views: list[memoryview]) -> None:
    """Fills `views` in order from a non-blocking socket: one recvmsg_into per arrival (scatter/gather), waiting on
    the loop only when nothing is there yet."""
    i = 0
    while i < len(views):
        try:
            got = sock.recvmsg_into(views[i : i + _IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        while i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]


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
        # Small pulls on the loop share a bounded set of connections: the data server holds each link to its own
        # share (MAX_CONNECTIONS_PER_LINK), and 64 concurrent small pulls must not each open one.
        self._loop_turns = asyncio.Semaphore(_LOOP_MAX_CONNECTIONS)
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
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())), self._loop_turns:
                sock = _fresh(self._loop_idle) or await self._connect_on_loop(loop)
                ok = False
                try:
                    await self._read_on_loop(loop, sock, remote.cache_id, dst, plan, progress, deadline)
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

    async def _read_on_loop(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, cache_id: int,
                            dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> None:
        """One READ with as few trips through the loop as the bytes allow: the request goes out at once (a small
        frame fits the socket's buffer), then the reply's head, then the payload and the trailer in one gather."""
        pieces = Pieces.of(plan)
        runs = pieces.runs()
        frame = _request_frame(b"KVRQ", cache_id, plan.src_tensor, plan.src_offset, plan.length, deadline)
        try:
            sent = sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(frame):
            await loop.sock_sendall(sock, memoryview(frame)[sent:])
        head = bytearray(REPLY.size)
        await _recv_views_on_loop(loop, sock, [memoryview(head)])
        magic, status, size = REPLY.unpack(head)
        if magic != b"KVRS":
            raise ConnectionError("bad reply frame")
        if status != 0:
            message = bytearray(min(size, 1 << 16))
            await _recv_views_on_loop(loop, sock, [memoryview(message)])
            _refused(status, message, "read")
        trailer = bytearray(TRAILER.size)
        try:
            await _recv_views_on_loop(loop, sock, [*(dst.views[dt][do : do + n] for _, _, _, dt, do, n in runs),
                                                   memoryview(trailer)])
        except OSError as e:
            if e.errno == errno.EFAULT:
                _local_memory_gone(dst, "a pull")
            raise
        sockio.fence(deadline)  # nothing that arrived late counts as landed
        for idx, _, _, _, _, n in runs:
            progress.mark(idx, n)
        _check_trailer(trailer, pieces, progress, cache_id)

    async def _connect_on_loop(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        sock = socket.socket(family(self._addr[0]), socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            tune(sock)
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
            tune(sock)
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
            with progress.on_cancel(lambda: shut_down(sock)):  # wakes this thread if it waits on the socket
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
        check_before_tls(sock, dst)
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
        check_before_tls(sock, src)
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
                        memcopy.copy_runs(staging.address(buf) + at, addresses(src, pieces.src_tensor[first:last],
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


