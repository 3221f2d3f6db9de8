"""The tcp data plane's wire format and the socket helpers both ends share.

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

import contextlib
import logging
import socket
import ssl
import struct
from typing import TYPE_CHECKING

import numpy as np

from kvbrokerd.links import linkauth

if TYPE_CHECKING:
    from kvbrokerd.registry.caches import CacheEntry

log = logging.getLogger(__name__)

NAME = "tcp"
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
"""Authenticated data connections open at once, over all links."""
MAX_CONNECTIONS_PER_LINK = 64
"""Authenticated data connections one link may hold open: a peer that hoards them (idle ones stay IDLE_TIMEOUT_S)
exhausts its own share, not MAX_CONNECTIONS. An honest puller holds at most 16 on the event loop (small pulls wait their
turn beyond that) and a few per worker-side transfer, so 64 leaves it ample room."""
IDLE_TIMEOUT_S = 600.0
"""An authenticated connection may wait this long for its next request (clients retire pooled ones sooner)."""
REQUEST_TIMEOUT_S = 10.0
MAX_REQUEST_S = 300.0
"""Longest a request may run (and pin its cache), whatever deadline its sender announces; version 1 gets this."""
STALL_TIMEOUT_S = 10.0
MIN_RATE_BYTES_PER_S = 1 << 20
RATE_WINDOW_S = 10.0
"""A request that moves less than MIN_RATE_BYTES_PER_S on average over any of its RATE_WINDOW_S windows is abandoned:
a peer that trickles must not pin a cache (blocking its release and its lease's expiry) for MAX_REQUEST_S. Any
link worth pulling KV blocks over moves far more; the defaults of `--tcp-min-rate` and `--tcp-rate-window-s`."""
SOCKET_BUFFER_BYTES = 4 << 20


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)



def shut_down(sock: socket.socket) -> None:
    """Wakes a thread blocked on `sock` (its call fails at once)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def vanished(what: str, during: str) -> str:
    return (f"{what} lost its memory during {during} (its shared-memory segment shrank or was removed by the model "
            "server)")



def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET



def addresses(entry: CacheEntry, tensor: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Raw addresses of runs of a mapped cache (its pin keeps them valid)."""
    at: np.ndarray = np.asarray(entry.addresses, dtype=np.uint64)[tensor] + offset
    return at


def check_before_tls(sock: socket.socket, entry: CacheEntry) -> None:
    """TLS copies payloads in user space (OpenSSL), where a vanished page is SIGBUS, not EFAULT: re-check the
    cache's segments under its pin first (plain sockets let the kernel turn the fault into EFAULT)."""
    if isinstance(sock, ssl.SSLSocket) and not entry.daemon_owned:
        entry.check_intact()
