"""What a linked peer said about the grants we renew on it, so that a pull by grant can skip `Peer.RedeemGrant`.

A decode daemon renews a waiting request's grant on the prefill daemon (the connector's GrantKeeper does it through
us); the renewal's answer carries what a redemption would (caches, blocks, units per block) and the grant's lease,
MAC'd under the link's secret. We keep that answer here, per link, and a later pull by the same grant uses it instead
of a round trip, but only when it is safe to:

- the secret the pull names is the one the renewal named (we keep a digest, never the secret: a wrong secret never
  reaches a remembered answer, it goes to the peer, which refuses it);
- the lease the peer stated, counted from when we *sent* the renewal (the peer started counting later, so this is
  conservative) and less SAFETY_S, outlasts the pull's deadline plus the hold margin the redeem path asks for. The
  peer never shortens a lease (renew and redeem only extend it), so the grant is alive, and its blocks unfreed,
  until after our pull has ended, unless it ends otherwise: released (through us: we forget it first; by anyone
  else: the peer keeps the blocks until the lease it stated to us is over, `GrantTable.release`; docs/THREAT_MODEL.md
  T21d), or its cache removed (the data plane refuses a removed cache: shm checks the peer's
  live-cache page before and after a copy, tcp looks the cache up in the peer's registry; cache ids are never
  reused).

An entry is dropped when its grant is released through us, when a renewal of it fails, when its lease is over, when
the link goes or is re-made (a restarted peer has a new epoch and none of its old grants), and when the cache is
full (MAX_ENTRIES grants or MAX_BLOCKS blocks; least recently used first).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbroker.tracecontext import TraceContext

MAX_ENTRIES = 4096
"""Remembered grants per link (a decode node's waiting requests on one prefill daemon; beyond: the least recently
used is forgotten and its pull redeems)."""
MAX_BLOCKS = 1 << 18
"""Granted blocks remembered per link, over all its entries (8 bytes each: 2 MiB; beyond: the least recently used
entries are forgotten; one answer larger than that is not remembered)."""
HOLD_MARGIN_S = 2.0
"""A peer holds granted blocks this much past our pull's deadline (asked for in a redeem, stated in a release): the
two daemons' clocks and schedules differ a little, and the blocks must outlast every read of the pull."""
SAFETY_S = 0.5
"""Taken off every remembered lease: the two daemons' clocks may run at slightly different rates, and a renewal's
answer may have been delayed on its way."""


@dataclass(frozen=True, slots=True)
class Remembered:
    """A grant as its daemon described it in a renewal's answer."""

    digest: bytes
    cache_ids: tuple[int, ...]
    blocks: array.array[int]
    units_per_block: int
    good_until: float
    """time.monotonic() until which the grant surely lives (the stated lease from our send, less SAFETY_S)."""
    traceparent: str = ""
    """The span the grant was made under, as its daemon said (validated: a W3C traceparent or empty)."""
    view_cache_ids: tuple[int, ...] = ()
    view_units_per_block: int = 1


def _valid_traceparent(traceparent: str) -> str:
    if not traceparent:
        return ""
    parsed = TraceContext.parse(traceparent)
    return "" if parsed is None else parsed.traceparent


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(b"kvbroker grant cache v1\0" + secret).digest()


class GrantCache:
    """One link's remembered grants, by grant id; runs on the event loop."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, Remembered] = OrderedDict()
        self._blocks = 0
        """Blocks of all entries (bounded by `max_blocks`)."""
        self.max_blocks = MAX_BLOCKS
        self._asking: dict[bytes, int] = {}
        """Grant id -> the ticket of the call now asking the peer about it (one per grant: a later call wins)."""
        self._tickets = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def asking(self, grant_id: bytes) -> int:
        """The ticket that `remember` needs: a release (or a failed call) of the grant while the peer was being asked
        voids it, so that a renewal answered just before a release is never remembered after it (the two calls may
        overtake each other on the way back). What is remembered stays usable meanwhile: the peer never shortens
        what it stated."""
        if len(self._asking) >= self.max_entries:  # calls that never came back (bounded all the same)
            self._asking.pop(next(iter(self._asking)))
        ticket = self._asking[bytes(grant_id)] = next(self._tickets)
        return ticket

    def remember(self, ticket: int, grant_id: bytes, secret: bytes, cache_ids: Sequence[int],
                 blocks: Sequence[int], units_per_block: int, sent_at: float, expires_in_ms: int,
                 traceparent: str = "", *, view_cache_ids: Sequence[int] = (), view_units_per_block: int = 1) -> None:
        """`ticket`: from `asking`, before the call was sent at `sent_at` (time.monotonic()); `expires_in_ms`: the
        lease the answer stated; `traceparent`: the grant's span, as the answer stated it (kept only if valid)."""
        if self._asking.get(bytes(grant_id)) != ticket:
            return  # released, failed or asked again meanwhile
        del self._asking[bytes(grant_id)]
        good_until = sent_at + expires_in_ms / 1000 - SAFETY_S
        self._drop(bytes(grant_id))
        if not cache_ids or not blocks or len(blocks) > self.max_blocks or good_until <= time.monotonic():
            return  # an older peer's answer (nothing to remember), a huge grant, or a lease too short to use
        self._entries[bytes(grant_id)] = Remembered(_digest(bytes(secret)), tuple(cache_ids), array.array("Q", blocks),
                                                    max(1, units_per_block), good_until,
                                                    _valid_traceparent(traceparent), tuple(view_cache_ids),
                                                    max(1, view_units_per_block))
        self._blocks += len(blocks)
        while len(self._entries) > self.max_entries or self._blocks > self.max_blocks:
            self._drop(next(iter(self._entries)))

    def lookup(self, grant_id: bytes, secret: bytes, need_s: float) -> Remembered | None:
        """The remembered grant if `secret` opens it and it surely lives `need_s` more seconds; else None (redeem)."""
        entry = self._entries.get(bytes(grant_id))
        if entry is None:
            return None
        now = time.monotonic()
        if entry.good_until <= now:
            self._drop(bytes(grant_id))
            return None
        if not hmac.compare_digest(entry.digest, _digest(bytes(secret))) or entry.good_until - now <= need_s:
            return None
        self._entries.move_to_end(bytes(grant_id))
        return entry

    def forget(self, grant_id: bytes, secret: bytes) -> None:
        """Forgets the grant, but only for its holder: a call with a wrong secret (which the peer refuses) must not
        make the holder's pulls redeem."""
        self._asking.pop(bytes(grant_id), None)
        entry = self._entries.get(bytes(grant_id))
        if entry is not None and hmac.compare_digest(entry.digest, _digest(bytes(secret))):
            self._drop(bytes(grant_id))

    def clear(self) -> None:
        self._entries.clear()
        self._asking.clear()
        self._blocks = 0

    def _drop(self, grant_id: bytes) -> None:
        entry = self._entries.pop(grant_id, None)
        if entry is not None:
            self._blocks -= len(entry.blocks)


class GrantReaders:
    """Our pulls by grant that may still read a peer's blocks, per grant, each until its deadline: a release we send
    through the link tells the peer how long they still read (the peer keeps the blocks until then, however the
    release came about: the connector's abort path releases while a pull of the same request may still run)."""

    def __init__(self) -> None:
        self._reading: dict[bytes, dict[int, float]] = {}
        self._ids = itertools.count()

    def begin(self, grant_id: bytes, until: float) -> Callable[[], None]:
        """Records a pull by `grant_id` that reads until `until` (time.monotonic()); returns what ends it early."""
        key, ident = bytes(grant_id), next(self._ids)
        self._reading.setdefault(key, {})[ident] = until

        def end() -> None:
            pulls = self._reading.get(key)
            if pulls is not None:
                pulls.pop(ident, None)
                if not pulls:
                    del self._reading[key]

        return end

    def hold_s(self, grant_id: bytes) -> float:
        """How long our pulls by `grant_id` may still read (0: none reads)."""
        now = time.monotonic()
        return max(0.0, max(self._reading.get(bytes(grant_id), {}).values(), default=now) - now)


__all__ = ["HOLD_MARGIN_S", "MAX_ENTRIES", "SAFETY_S", "GrantCache", "GrantReaders", "Remembered"]
