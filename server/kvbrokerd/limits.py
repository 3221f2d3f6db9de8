"""Maximum sizes of what the local API accepts (docs/LIMITS.md lists every limit and where it is enforced).

Each string a caller sends is bounded, so that no request can make a reply too large to deliver (an AllocateCache
whose reply the caller cannot receive leaves an orphaned cache) or a listing too large for everyone (ListCaches).
A value over its limit is refused with LLM_PARAM_INVALID before anything is created or changed. Strings must also be
printable: they end up in logs and tables.
"""

from __future__ import annotations

from kvbrokerd.errors import param_invalid

MAX_LAYOUT_TAG_BYTES = 256
"""CacheDesc.layout_tag (UTF-8 bytes)."""
MAX_SESSION_ID_BYTES = 128
"""session_id of AllocateCache, RegisterKvCache and KeepAlive (UTF-8 bytes)."""
MAX_ADDRESS_BYTES = 512
"""ClusterInfo.remote_address of LinkClusters and UnlinkClusters (UTF-8 bytes)."""
MAX_LEASE_TTL_S = 86400.0
"""KeepAlive.ttl_ms, in seconds: one day."""
MAX_CACHE_LISTING_BYTES = 48 << 20
"""All CacheInfo messages together, i.e. the ListCaches reply: below the 64 MiB message limit of the daemon and the
Python client, with room to spare. A cache that would push the listing past it is refused (LLM_OUT_OF_MEMORY)."""
DEFAULT_SESSION_MESSAGE_PAIRS = 1 << 20
"""Block pairs that the pulls of one PullKvBlocksSession message may name in all, by default
(`--max-session-message-pairs`): as many as one PullKvBlocks may, so that a message costs what one request does. A
message with more has every pull refused (LLM_PARAM_INVALID), counted before any pair is written out."""


def check_text(field: str, value: str, max_bytes: int, *, required: bool = False) -> None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if required and size == 0:
        param_invalid(f"{field} must not be empty")
    if size > max_bytes:
        param_invalid(f"{field} is {size} bytes long; at most {max_bytes}")
    if not value.isprintable():
        param_invalid(f"{field} holds a control or non-printable character")
