"""Peer authentication: the deployment token, the link handshake's proofs, the per-link secret, and the proofs that
peer calls and data connections give of it.

Link handshake (two gRPC calls; protocol v2):

    caller -> responder   Handshake(caller id, caller epoch, expected id, caller nonce Nc)
    responder -> caller   (challenge id, responder nonce Nr, responder proof = MAC(K, "responder" | binding))
    caller -> responder   Authenticate(challenge id, caller proof = MAC(K, "caller" | binding))
    responder -> caller   its description (epoch, backends, data address, shm probe)

binding = both cluster ids (the caller's and the one it expects), the caller's epoch and both nonces; K is derived
from the deployment token (or empty where mutual TLS alone, or `--insecure-peers`, authenticates peers). The link
secret is derived from K and the same binding on both sides: neither the token nor any secret ever travels. A
responder answers a stranger's Handshake with fresh random bytes and a proof the stranger cannot check, and refuses
its Authenticate with a message that names nothing.

Later peer calls carry a LinkProof (link id, a per-link sequence number, MAC over the call); the answers that matter
(Authenticate's self-description, cache descriptions, grants) carry a MAC over the answer bound to the call's link id
and sequence number (protocol v3), so a relay between two daemons can neither rewrite nor replay them; data
connections answer a fresh nonce with MAC(secret, nonce | link id) (see the tcp backend).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import threading
from pathlib import Path

SECRET_BYTES = 32
ID_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = 32
CHALLENGE_ID_BYTES = 16
MIN_TOKEN_BYTES = 16
MAX_TOKEN_FILE_BYTES = 4096
_ID_LABEL = b"kvbroker link id v1"
_MAC_LABEL = b"kvbroker data connection v1"
_KEY_LABEL = b"kvbroker peer token v2"
_SECRET_LABEL = b"kvbroker link secret v2"
_CALL_LABEL = b"kvbroker peer call v2"
_ANSWER_LABEL = b"kvbroker peer answer v3"
REPLAY_WINDOW = 4096


class TokenError(ValueError):
    """The token file is missing, unreadable, too short or readable by other users."""


def load_token(path: str | os.PathLike[str]) -> bytes:
    """The deployment token from `path` (surrounding whitespace ignored). Refuses a file that other users can read:
    whoever reads it can link to every daemon of the deployment."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise TokenError(f"cannot open {p}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"{p} is not a regular file")
        if st.st_mode & stat.S_IROTH:
            raise TokenError(f"{p} is readable by every user (mode {stat.S_IMODE(st.st_mode):o}); chmod o-rwx it")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise TokenError(f"{p} is larger than {MAX_TOKEN_FILE_BYTES} bytes")
    token = data.strip()
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenError(f"{p} holds {len(token)} bytes; a token needs at least {MIN_TOKEN_BYTES} "
                         "(e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return token


def token_key(token: bytes | None) -> bytes:
    """K: the key the handshake proofs use (empty without a token: mutual TLS or --insecure-peers)."""
    return b"" if not token else hmac.new(token, _KEY_LABEL, hashlib.sha256).digest()


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_challenge_id() -> bytes:
    return secrets.token_bytes(CHALLENGE_ID_BYTES)


def binding(caller_id: int, expected_id: int, caller_epoch: str, caller_nonce: bytes, responder_nonce: bytes,
            protocol_version: int) -> bytes:
    epoch = caller_epoch.encode()
    return (struct.pack("<IQQH", protocol_version, caller_id, expected_id, len(epoch)) + epoch
            + caller_nonce + responder_nonce)


def handshake_proof(key: bytes, role: bytes, bound: bytes) -> bytes:
    """role: b"caller" or b"responder" (different labels, so one side's proof is never the other's)."""
    return hmac.new(key or b"\0", b"kvbroker handshake v2 " + role + b"\0" + bound, hashlib.sha256).digest()


def derive_link_secret(key: bytes, bound: bytes) -> bytes:
    return hmac.new(key or b"\0", _SECRET_LABEL + bound, hashlib.sha256).digest()


def link_id(secret: bytes) -> bytes:
    """The public name of a link: lets the server find the secret without the secret being sent."""
    return hashlib.sha256(_ID_LABEL + secret).digest()[:ID_BYTES]


def proof(secret: bytes, nonce: bytes, lid: bytes) -> bytes:
    return hmac.new(secret, _MAC_LABEL + nonce + lid, hashlib.sha256).digest()


def verify(secret: bytes, nonce: bytes, lid: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(secret, nonce, lid), mac)


def call_mac(secret: bytes, method: str, lid: bytes, seq: int, body: bytes) -> bytes:
    """MAC of one peer call: binds the method, the link, the sequence number and the request's other fields."""
    head = _CALL_LABEL + method.encode() + b"\0" + lid + struct.pack("<Q", seq)
    return hmac.new(secret, head + body, hashlib.sha256).digest()


def answer_mac(secret: bytes, method: str, lid: bytes, seq: int, body: bytes) -> bytes:
    """MAC of a peer's answer to the call (method, link, seq): a relay cannot rewrite it, nor replay an answer to
    another call (a different seq). Its own label: an answer's MAC is never a valid call MAC, nor the reverse."""
    head = _ANSWER_LABEL + method.encode() + b"\0" + lid + struct.pack("<Q", seq)
    return hmac.new(secret, head + body, hashlib.sha256).digest()


class ReplayWindow:
    """Accepts each sequence number once, within a sliding window of the highest seen (calls may arrive out of
    order: a heartbeat and a cache lookup overtake each other)."""

    def __init__(self) -> None:
        self._highest = 0
        self._seen = 0  # bit i: highest - i was accepted
        self._lock = threading.Lock()

    def accept(self, seq: int) -> bool:
        with self._lock:
            if seq == 0:
                return False
            if seq > self._highest:
                shift = seq - self._highest
                self._seen = ((self._seen << shift) | 1) & ((1 << REPLAY_WINDOW) - 1) if shift < REPLAY_WINDOW else 1
                self._highest = seq
                return True
            age = self._highest - seq
            if age >= REPLAY_WINDOW or self._seen >> age & 1:
                return False
            self._seen |= 1 << age
            return True
