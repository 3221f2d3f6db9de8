"""Grants: held blocks as capabilities with leases.

A local client (the prefill engine, when a request finishes) grants some blocks of its caches and gets an
unguessable grant: a public id and a secret. Whoever holds both may renew the grant's lease, redeem it (a linked
peer's daemon, to learn which cache and blocks it may pull) or release it; nobody else can name the blocks. A grant
ends when it is released, when its lease lapses (its holder died or forgot it), when renewals would keep it past its
cap, or when one of its caches is removed; each end is posted once, as a GrantEvent, on the topics the creator named,
so the creator frees the blocks then and only then.

The table holds only a digest of each secret (compared in constant time), so nothing it lists or logs lets anyone
use a grant. A wrong secret reads exactly like an unknown grant: the answer is no oracle for which ids exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbrokerd.errors import LlmStatus, fail, param_invalid
from kvbrokerd.limits import check_text

log = logging.getLogger(__name__)

ID_BYTES = 16
SECRET_BYTES = 32
MAX_GRANTS = 65536
MAX_CACHES = 64
MAX_BLOCKS = 65536
MAX_TOPICS = 64
MAX_TOPIC_BYTES = 128
MAX_LABEL_BYTES = 128
MIN_LEASE_S = 0.1
MAX_LEASE_S = 3600.0
MAX_HOLD_S = 86400.0
MAX_REDEEM_HOLD_S = 600.0
MAX_UNITS_PER_BLOCK = 1 << 16
SWEEP_INTERVAL_S = 0.1
MAX_PROMISES = 16
"""Links a grant's renewals may describe it to (one per decode daemon that renews it; beyond: renewals still renew,
but describe nothing, so those peers redeem before they pull)."""
STALL_S = 0.25
"""A sweep this much later than planned means the daemon did not run in between (see sessions.py)."""


@dataclass(eq=False, slots=True)
class Grant:
    grant_id: bytes
    digest: bytes
    cache_ids: tuple[int, ...]
    blocks: tuple[int, ...]
    block_set: frozenset[int]
    lease_s: float
    expires: float  # time.monotonic()
    cap: float  # time.monotonic(): renewals never move `expires` past it
    label: str
    event_topics: tuple[str, ...]
    units_per_block: int = 1
    """Each granted block stands for this many consecutive blocks of the caches."""
    promised: dict[object, float] = field(default_factory=dict)
    """Peer link -> time.monotonic() until which a renewal's answer told that peer the grant lives (the peer may
    pull until then without redeeming): a release by anyone else keeps the blocks until then (see `release`)."""

    def expires_in_ms(self) -> int:
        return max(0, min(0xFFFFFFFF, int((self.expires - time.monotonic()) * 1000)))


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(b"kvbroker grant v1\0" + secret).digest()


def lease_of(lease_ms: int, *, optional: bool = False) -> float | None:
    if optional and lease_ms == 0:
        return None
    lease_s = lease_ms / 1000
    if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
        param_invalid(f"lease_ms must be in [{int(MIN_LEASE_S * 1000)}, {int(MAX_LEASE_S * 1000)}], got {lease_ms}")
    return lease_s


class GrantTable:
    """Runs on the event loop. `on_end(grant, outcome)` posts the grant's events (it must not raise)."""

    def __init__(self, on_end: Callable[[Grant, str], None], *, max_grants: int = MAX_GRANTS) -> None:
        self._grants: dict[bytes, Grant] = {}
        self._draining: dict[bytes, Grant] = {}
        """Released grants whose blocks a peer was promised (`Grant.promised`): unusable, ended at `expires`."""
        self._on_end = on_end
        self.max_grants = max_grants
        self._sweeper: asyncio.Task[None] | None = None
        self.ended: dict[str, int] = {}
        """Grants ended so far, by outcome (for metrics and tests)."""
        self.redeemed = 0
        """Redemptions answered so far (a peer's pull that could not use a renewal's answer; for metrics and tests)."""

    def __len__(self) -> int:
        return len(self._grants)

    # -- the holder's operations ---------------------------------------------------------------------------------
    def create(self, cache_ids: Sequence[int], blocks: Sequence[int], lease_ms: int, max_hold_ms: int, label: str,
               event_topics: Sequence[str], num_blocks_of: Callable[[int], int], units_per_block: int = 1
               ) -> tuple[Grant, bytes]:
        """`num_blocks_of(cache_id)`: the cache's block count (fails for an unknown cache)."""
        units = units_per_block or 1
        if not 1 <= units <= MAX_UNITS_PER_BLOCK:
            param_invalid(f"units_per_block must be in [0, {MAX_UNITS_PER_BLOCK}], got {units_per_block}")
        self.sweep()
        if not 1 <= len(cache_ids) <= MAX_CACHES:
            param_invalid(f"a grant covers 1..{MAX_CACHES} caches, got {len(cache_ids)}")
        if len(set(cache_ids)) != len(cache_ids):
            param_invalid("cache_ids repeat a cache")
        if not 1 <= len(blocks) <= MAX_BLOCKS:
            param_invalid(f"a grant covers 1..{MAX_BLOCKS} blocks, got {len(blocks)}")
        block_set = frozenset(int(b) for b in blocks)
        if len(block_set) != len(blocks):
            param_invalid("blocks repeat a block")
        for cache_id in cache_ids:
            if (max(block_set) + 1) * units > (n := num_blocks_of(cache_id)):
                param_invalid(f"block {max(block_set)} (of {units} blocks each) is out of range for cache "
                              f"{cache_id} ({n} blocks)")
        lease_s = lease_of(lease_ms)
        assert lease_s is not None
        hold_s = max_hold_ms / 1000 if max_hold_ms else MAX_HOLD_S
        if not lease_s <= hold_s <= MAX_HOLD_S:
            param_invalid(f"max_hold_ms must be 0 or in [lease_ms, {int(MAX_HOLD_S * 1000)}], got {max_hold_ms}")
        check_text("label", label, MAX_LABEL_BYTES)
        if len(event_topics) > MAX_TOPICS:
            param_invalid(f"at most {MAX_TOPICS} event topics, got {len(event_topics)}")
        for topic in event_topics:
            if not 1 <= len(topic.encode()) <= MAX_TOPIC_BYTES:
                param_invalid(f"an event topic must be 1..{MAX_TOPIC_BYTES} bytes")
        if len(self._grants) + len(self._draining) >= self.max_grants:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"grant limit reached ({self.max_grants}); release grants first")
        grant_id, secret = secrets.token_bytes(ID_BYTES), secrets.token_bytes(SECRET_BYTES)
        now = time.monotonic()
        grant = Grant(grant_id, _digest(secret), tuple(int(c) for c in cache_ids), tuple(int(b) for b in blocks),
                      block_set, lease_s, now + lease_s, now + hold_s, label, tuple(event_topics), units)
        self._grants[grant_id] = grant
        return grant, secret

    def get(self, grant_id: bytes, secret: bytes) -> Grant:
        """The live grant that `secret` opens; an unknown id, a wrong secret and an ended grant read the same."""
        grant = self._grants.get(bytes(grant_id))
        if grant is not None and grant.expires <= time.monotonic():
            self.sweep()
            grant = None
        if grant is None or not hmac.compare_digest(grant.digest, _digest(bytes(secret))):
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, "grant unknown, lapsed or released (or the secret is wrong)")
        return grant

    def renew(self, grant_id: bytes, secret: bytes, lease_ms: int) -> Grant:
        lease_s = lease_of(lease_ms, optional=True)
        grant = self.get(grant_id, secret)
        if lease_s is not None:
            grant.lease_s = lease_s
        grant.expires = min(grant.cap, max(grant.expires, time.monotonic() + grant.lease_s))
        return grant

    def redeem(self, grant_id: bytes, secret: bytes, hold_ms: int) -> Grant:
        """The grant, kept alive at least `hold_ms` (within its cap): a pull that began in time never reads blocks
        that were freed under it."""
        grant = self.get(grant_id, secret)
        self.redeemed += 1
        hold_s = min(hold_ms / 1000, MAX_REDEEM_HOLD_S)
        grant.expires = min(grant.cap, max(grant.expires, time.monotonic() + hold_s))
        return grant

    def promise(self, grant: Grant, to: object) -> bool:
        """Records that `to` (a peer's link) is told the grant lives until its current `expires`; False when the
        grant has promised too many links already (then `to` must not be told)."""
        now = time.monotonic()
        for key in [k for k, until in grant.promised.items() if until <= now]:
            del grant.promised[key]
        if to not in grant.promised and len(grant.promised) >= MAX_PROMISES:
            return False
        grant.promised[to] = grant.expires
        return True

    def release(self, grant_id: bytes, secret: bytes, by: object = None) -> None:
        """Ends the grant at once for every use; its blocks are freed (its event posted) at once too, unless a
        renewal told another peer link than `by` (the link the release came over; None: a local client) that the
        grant lives longer: that peer may pull without asking again, so the blocks stay until then."""
        grant = self.get(grant_id, secret)
        now = time.monotonic()
        promised = max((until for key, until in grant.promised.items() if key is not by), default=now)
        if promised <= now:
            self._end(grant, "released")
            return
        del self._grants[grant.grant_id]
        grant.expires = grant.cap = promised
        self._draining[grant.grant_id] = grant

    # -- ends the holder did not ask for ------------------------------------------------------------------------
    def cache_removed(self, cache_id: int) -> None:
        for grant in [g for g in self._grants.values() if cache_id in g.cache_ids]:
            self._end(grant, "cache removed")
        for grant in [g for g in self._draining.values() if cache_id in g.cache_ids]:
            self._drained(grant)

    def sweep(self) -> None:
        now = time.monotonic()
        for grant in [g for g in self._grants.values() if g.expires <= now]:
            self._end(grant, "capped" if grant.expires >= grant.cap else "lapsed")
        for grant in [g for g in self._draining.values() if g.expires <= now]:
            self._drained(grant)

    def _drained(self, grant: Grant) -> None:
        """A released grant's last promise is over (or its cache gone): its blocks are freed now."""
        if self._draining.pop(grant.grant_id, None) is not None:
            self._grants[grant.grant_id] = grant
            self._end(grant, "released")

    def forgive_stall(self, stalled_s: float) -> None:
        """The daemon did not run for `stalled_s`: no renewal could be heard, so that time does not count."""
        for grant in [*self._grants.values(), *self._draining.values()]:
            grant.expires += stalled_s
            grant.cap += stalled_s

    def _end(self, grant: Grant, outcome: str) -> None:
        if self._grants.pop(grant.grant_id, None) is None:
            return
        self.ended[outcome] = self.ended.get(outcome, 0) + 1
        if outcome != "released":
            log.info("grant %s (%s) ended: %s", grant.grant_id.hex()[:8], grant.label, outcome)
        self._on_end(grant, outcome)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep_forever(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            late = time.monotonic() - last - SWEEP_INTERVAL_S
            if late > STALL_S:
                self.forgive_stall(late + SWEEP_INTERVAL_S)
            try:
                self.sweep()
            except Exception:  # one bad event post must not stop every later expiry
                log.exception("grant sweep failed")
            last = time.monotonic()
