"""Link secrets and the proof a data connection gives that it belongs to an established link.

The handshake (over the peer gRPC API, mutually authenticated with TLS where configured) hands the dialling daemon
a random per-link secret. A data connection never carries that secret: the server sends a fresh nonce, the client
answers with the link's public id and HMAC-SHA256(secret, nonce || id). A stranger, or a replay of an old
connection, gets nothing but a closed socket.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_BYTES = 32
ID_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = 32
_ID_LABEL = b"kvbroker link id v1"
_MAC_LABEL = b"kvbroker data connection v1"


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def link_id(secret: bytes) -> bytes:
    """The public name of a link: lets the server find the secret without the secret being sent."""
    return hashlib.sha256(_ID_LABEL + secret).digest()[:ID_BYTES]


def proof(secret: bytes, nonce: bytes, lid: bytes) -> bytes:
    return hmac.new(secret, _MAC_LABEL + nonce + lid, hashlib.sha256).digest()


def verify(secret: bytes, nonce: bytes, lid: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(secret, nonce, lid), mac)
