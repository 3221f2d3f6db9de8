"""Socket I/O of the tcp data plane: bytes move straight between sockets and cache memory, and no call waits longer
than its request may.

A `Watch` says how long each blocking call of one request may wait: until the request's deadline; optionally not
longer than `stall_s` without a byte of progress; optionally not below a `MinRate` (a peer that reads or writes a
few bytes now and then makes progress, yet would hold the cache it pins for as long as its deadline allows); and,
with `abandon`, a blocked call wakes every POLL_S to ask whether to give up (the serving side stops feeding a reader
that stopped reading once the cache is being released).

Memory that vanished under a copy (a model server truncated its segment) makes the kernel answer EFAULT instead of
raising SIGBUS; it becomes a `MemoryFault` that says how many bytes had moved, so that callers fail the transfer that
touched that memory instead of blaming the connection.
"""

from __future__ import annotations

import errno
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from socket import SO_SNDTIMEO, SOL_SOCKET, socket

IOV_BATCH = 512
"""Buffers per sendmsg/recvmsg_into call: one system call moves many small runs (Linux allows 1024)."""
POLL_S = 0.25
_ZEROS = memoryview(bytes(1 << 20))
_SCRATCH_BYTES = 1 << 20


class MemoryFault(Exception):
    """Cache memory given to a socket call is gone (EFAULT); `done` bytes of the call's buffers had moved."""

    def __init__(self, done: int) -> None:
        super().__init__(f"memory vanished after {done} bytes")
        self.done = done


@dataclass(frozen=True)
class MinRate:
    """Each `window_s` of a request must move at least `bytes_per_s * window_s` bytes; 0 bytes/s: no minimum."""

    bytes_per_s: int
    window_s: float


class Watch:
    def __init__(self, deadline: float, stall_s: float | None = None,
                 abandon: Callable[[], str | None] | None = None, min_rate: MinRate | None = None) -> None:
        self.deadline = deadline
        self._stall_s = stall_s
        self._abandon = abandon
        self._progress_at = time.monotonic()
        self._rate = min_rate if min_rate is not None and min_rate.bytes_per_s > 0 else None
        # Windows, not the average since the start: the kernel's buffers take megabytes at once, which would let a
        # peer trickle for a long time on the credit of its first burst.
        self._window_at = self._progress_at
        self._window_bytes = 0

    def timeout(self, final: bool = False) -> float:
        """Seconds the next call may wait; raises TimeoutError when none are left. `final`: the call cannot be
        resumed after a timeout (TLS), so it gets all the time left instead of a poll slice."""
        now = time.monotonic()
        left = self.deadline - now
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        if self._stall_s is not None:
            left = min(left, self._progress_at + self._stall_s - now)
            if left <= 0:
                raise TimeoutError(f"no progress for {self._stall_s:g} s")
        if self._rate is not None:
            self._check_rate(now)
            if not final:  # wake at the window's end to judge it, even while the peer moves nothing
                left = min(left, max(0.001, self._window_at + self._rate.window_s - now))
        return left if final or self._abandon is None else min(left, POLL_S)

    def _check_rate(self, now: float) -> None:
        assert self._rate is not None
        elapsed = now - self._window_at
        if elapsed < self._rate.window_s:
            return
        if self._window_bytes < self._rate.bytes_per_s * elapsed:
            raise TimeoutError(f"the peer moved {self._window_bytes} bytes in {elapsed:.1f} s, below the minimum "
                               f"of {self._rate.bytes_per_s} bytes/s")
        self._window_at, self._window_bytes = now, 0

    @property
    def deadline_only(self) -> bool:
        return self._stall_s is None and self._abandon is None and self._rate is None

    @property
    def in_slices(self) -> bool:
        """Calls wait in POLL_S slices (to ask `abandon`), so a bulk send may block in the kernel that long."""
        return self._abandon is not None

    def progressed(self, nbytes: int) -> None:
        if self._stall_s is not None or self._rate is not None:
            self._progress_at = now = time.monotonic()
            if self._rate is not None:
                self._window_bytes += nbytes
                self._check_rate(now)

    def waited(self) -> None:
        """A call used up its timeout: raises if the request must end now, else the caller tries again."""
        if self._abandon is not None and (why := self._abandon()):
            raise ConnectionAbortedError(why)
        self.timeout()


def _is_fault(e: OSError) -> bool:
    return e.errno == errno.EFAULT


def _advance(views: list[memoryview], i: int, done: int) -> tuple[int, list[int]]:
    """After `done` more bytes of views[i:], returns (new i, indices of views completed); trims views[new i]."""
    completed = []
    while done and done >= len(views[i]):
        done -= len(views[i])
        completed.append(i)
        i += 1
    if done:
        views[i] = views[i][done:]
    return i, completed


def send_views(sock: socket, views: list[memoryview], watch: Watch) -> None:
    """Sends `views` in order (scatter/gather); raises MemoryFault if one of them lost its memory."""
    if isinstance(sock, ssl.SSLSocket):  # TLS has no scatter/gather: one record stream, view by view
        for v in views:
            sock.settimeout(watch.timeout(final=True))
            sock.sendall(v)
            watch.progressed(len(v))
        return
    views = list(views)
    i = done = 0
    # A socket with a Python timeout is non-blocking: each sendmsg stops when the send buffer is full and needs a
    # poll(2) before the next. A blocking socket with a kernel send timeout moves a whole batch per call instead,
    # and still returns (EAGAIN, or a partial count) after POLL_S to let us check the deadline and `abandon`.
    in_kernel = watch.in_slices
    if in_kernel:
        sock.settimeout(None)
        _send_timeout(sock, POLL_S)
    try:
        while i < len(views):
            if not in_kernel:
                sock.settimeout(watch.timeout())
            try:
                sent = sock.sendmsg(views[i : i + IOV_BATCH])
            except (TimeoutError, BlockingIOError):
                watch.waited()
                continue
            except OSError as e:
                if _is_fault(e):
                    raise MemoryFault(done) from e
                raise
            done += sent
            watch.progressed(sent)
            if in_kernel:
                watch.timeout()  # raises once the deadline has passed, however steadily the reader reads
            i, _ = _advance(views, i, sent)
    finally:
        if in_kernel:
            _send_timeout(sock, 0.0)


def _send_timeout(sock: socket, seconds: float) -> None:
    """SO_SNDTIMEO (0 = none) of a blocking socket."""
    whole = int(seconds)
    sock.setsockopt(SOL_SOCKET, SO_SNDTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def recv_views(sock: socket, views: list[memoryview], on_complete: Callable[[int], object], watch: Watch) -> None:
    """Fills `views` in order straight from the socket; calls on_complete(index) as each fills; raises MemoryFault
    if one of them lost its memory (the stream then stands just before the byte that did not land)."""
    if isinstance(sock, ssl.SSLSocket):
        for k, v in enumerate(views):
            recv_exact(sock, v, watch)
            fence(watch.deadline)
            on_complete(k)
        return
    views = list(views)
    i = done = 0
    # The pulling side's hot loop (one pass per few dozen KiB): only the deadline to check, inline.
    lean, deadline, count = watch.deadline_only, watch.deadline, len(views)
    while i < count:
        if lean:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's deadline passed")
            sock.settimeout(left)
        else:
            sock.settimeout(watch.timeout())
        try:
            got = sock.recvmsg_into(views[i : i + IOV_BATCH])[0]
        except TimeoutError:
            watch.waited()
            continue
        except OSError as e:
            if _is_fault(e):
                raise MemoryFault(done) from e
            raise
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        fence(deadline)
        done += got
        if not lean:
            watch.progressed(got)
        i, completed = _advance(views, i, got)
        for k in completed:
            on_complete(k)


def fence(deadline: float) -> None:
    """Bytes that arrived after the request's deadline never count as landed: a daemon that resumes from a freeze
    past the deadline fails the request before it records them (they may have left the peer after its hold ended)."""
    if time.monotonic() > deadline:
        raise TimeoutError("the request's deadline passed during a receive")


def recv_exact(sock: socket, view: memoryview, watch: Watch) -> None:
    final = isinstance(sock, ssl.SSLSocket)
    pos, end = 0, len(view)
    while pos < end:
        sock.settimeout(watch.timeout(final))
        try:
            got = sock.recv_into(view[pos:], end - pos)
        except TimeoutError:
            if final:
                raise
            watch.waited()
            continue
        if got == 0:
            raise ConnectionError("peer closed the data connection")
        pos += got
        watch.progressed(got)


def recv_bytes(sock: socket, n: int, watch: Watch) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), watch)
    return bytes(buf)


def send_all(sock: socket, data: bytes | memoryview, watch: Watch) -> None:
    view = memoryview(data)
    final = isinstance(sock, ssl.SSLSocket)
    while len(view):
        sock.settimeout(watch.timeout(final))
        try:
            sent = sock.send(view)
        except TimeoutError:
            if final:
                raise
            watch.waited()
            continue
        view = view[sent:]
        watch.progressed(sent)


def send_zeros(sock: socket, n: int, watch: Watch) -> None:
    """Pads a stream whose source memory vanished, so that the reader's framing stays intact."""
    while n > 0:
        chunk = min(n, len(_ZEROS))
        send_all(sock, _ZEROS[:chunk], watch)
        n -= chunk


def drain(sock: socket, n: int, watch: Watch) -> None:
    """Reads and drops `n` bytes (a payload whose destination memory vanished), keeping the stream in step."""
    scratch = memoryview(bytearray(min(n, _SCRATCH_BYTES)))
    while n > 0:
        chunk = min(n, len(scratch))
        recv_exact(sock, scratch[:chunk], watch)
        n -= chunk
