"""A raw client of a daemon's tcp data port, for tests that play a misbehaving (but linked) peer.

It links to the daemon through the real Peer API (as a made-up cluster), then speaks the data-port frames of
`kvbrokerd.backends.tcp.channel` by hand: enough to stop reading mid-reply, hold connections open, or drip bytes.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import numpy as np

from kvbroker._local import LocalDaemon
from kvbrokerd.backends.tcp import wire as tcp
from kvbrokerd.links import linkauth
from tests.peerkit import link_as, token_of


def unsent_to(sock: socket.socket) -> int:
    """Bytes the daemon's end of our connection `sock` has written and we have not taken in (its socket's tx_queue
    in /proc/net/tcp): when this stops growing while we read nothing, the daemon's sender is stuck in send."""
    key = (_proc_address(sock.getpeername()), _proc_address(sock.getsockname()))
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == key:
            return int(fields[4].split(":")[0], 16)
    raise LookupError(f"no socket {key[0]} -> {key[1]} in /proc/net/tcp")


def _proc_address(address: tuple[str, int]) -> str:
    """An IPv4 address as /proc/net/tcp writes it: the address's 32-bit word in host byte order, then the port."""
    host, port = address
    return f"{int.from_bytes(socket.inet_aton(host), 'little'):08X}:{port:04X}"


def fake_link(d: LocalDaemon, cluster_id: int = 77) -> tuple[bytes, int]:
    """Links to `d` as cluster `cluster_id` through its Peer API, holding the deployment token (a compromised peer,
    see tests/peerkit.py): (link secret, data port)."""
    link = link_as(d.peer_address, token_of(d.workdir), cluster_id, d.cluster_id)
    link.close()
    return link.secret, link.data_port


def connect(port: int, secret: bytes, version: int = tcp.VERSION, timeout: float = 5.0,
            rcvbuf: int = 0) -> socket.socket:
    """An authenticated data connection (raises if the daemon does not answer READY)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    greeting = sock.recv(4 + linkauth.NONCE_BYTES, socket.MSG_WAITALL)
    if greeting[:4] != b"KVCH":
        sock.close()
        raise ConnectionError(f"no greeting: {greeting!r}")
    lid = linkauth.link_id(secret)
    sock.sendall(tcp.HELLO.pack(b"KVHI", version, 0, lid, linkauth.proof(secret, greeting[4:], lid)))
    if sock.recv(4, socket.MSG_WAITALL) != b"KVOK":
        sock.close()
        raise ConnectionError("the daemon refused the link proof")
    return sock


def read_request(cache_id: int, runs: list[tuple[int, int, int]], deadline_ms: int | None) -> bytes:
    """A READ frame of (tensor, offset, length) runs; `deadline_ms=None` writes a version-1 frame."""
    frame = np.zeros(len(runs), dtype=tcp.RUN)
    frame["tensor"], frame["offset"], frame["length"] = zip(*runs, strict=True)
    head = (struct.pack("<4sIq", b"KVRQ", len(runs), cache_id) if deadline_ms is None else
            tcp.REQUEST.pack(b"KVRQ", len(runs), cache_id, deadline_ms, 0))
    return head + frame.tobytes()
