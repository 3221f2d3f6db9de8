"""Grants: held blocks as capabilities with leases.

A local client (the prefill engine, when a request finishes) grants some blocks of its caches and gets an
unguessable grant: a public id and a secret. Whoever holds both may renew the grant's lease, redeem it (a linked
peer's daemon, to learn which cache and blocks it may pull) or release it; nobody else can name the blocks. A grant
ends when it is released, when its lease lapses (its holder died or forgot it), when renewals would keep it past its
cap, or when one of its caches is removed; each end is posted once, as a GrantEvent, on the topics the creator named,
so the creator frees the blocks then and only then.

The promise a pull relies on is kept here, in one place: every peer link that may read a grant's blocks (a redeemed
pull, until its deadline plus a margin; a renewal's answer, until the lease it stated) holds them (`Grant.holds`).
No end of the grant frees blocks that a link holds: a lapse or the cap cannot come first (a redeem extends the
lease to its hold, and the puller refuses an answer whose grant ends before its deadline), and a release, by anyone,
ends the grant for new uses at once but posts its event (which lets the creator free the blocks) only when the last
hold is over. The link a release comes through states how long its own pulls still read (`release(hold_s=)`).

The table holds only a digest of each secret (compared in constant time), so nothing it lists or logs lets anyone
use a grant. A wrong secret reads exactly like an unknown grant: the answer is no oracle for which ids exist.
"""

from __future__ import annotations

import array
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
MAX_HOLDERS = 16
"""Links that may hold one grant's blocks at once (one per decode daemon that renews or redeems it; beyond: renewals
still renew, but describe nothing, and a redeem is refused)."""
MAX_GRANTED_BLOCKS = 1 << 22
"""Blocks that all grants together may cover (4 bytes each: 16 MiB), unless the daemon is told otherwise."""
STALL_S = 0.25
"""A sweep this much later than planned means the daemon did not run in between (see sessions.py)."""


@dataclass(eq=False, slots=True)
class Grant:
    grant_id: bytes
    digest: bytes
    cache_ids: tuple[int, ...]
    blocks: array.array[int]
    """Compact (4 or 8 bytes a block): a grant may cover 65,536 blocks, and thousands of grants may live."""
    lease_s: float
    expires: float  # time.monotonic()
    cap: float  # time.monotonic(): renewals never move `expires` past it
    label: str
    event_topics: tuple[str, ...]
    units_per_block: int = 1
    """Each granted block stands for this many consecutive blocks of the caches."""
    view_cache_ids: tuple[int, ...] = ()
    """The same blocks in these caches too (other views of the caches' memory), in slots len(cache_ids) onwards."""
    view_units_per_block: int = 1
    traceparent: str = ""
    """The span CreateGrant ran under (tracing on), which a peer's pull by the grant links to; else empty."""
    holds: dict[object, float] = field(default_factory=dict)
    """Peer link -> time.monotonic() until which that link may read the blocks: a redeemed pull's hold, or the lease
    a renewal's answer stated (the peer may pull until then without redeeming). No end frees the blocks earlier."""

    def expires_in_ms(self) -> int:
        return max(0, min(0xFFFFFFFF, int((self.expires - time.monotonic()) * 1000)))


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(b"kvbroker grant v1\0" + secret).digest()


def _block_array(blocks: Sequence[int]) -> array.array[int]:
    """The blocks, 4 bytes each where they fit (8 otherwise); a negative block is refused."""
    if not blocks:
        return array.array("I")
    try:
        return array.array("I" if max(blocks) < 1 << 32 else "Q", blocks)
    except (OverflowError, TypeError):
        param_invalid("blocks must be integers in [0, 2^64)")


def lease_of(lease_ms: int, *, optional: bool = False) -> float | None:
    if optional and lease_ms == 0:
        return None
    lease_s = lease_ms / 1000
    if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
        param_invalid(f"lease_ms must be in [{int(MIN_LEASE_S * 1000)}, {int(MAX_LEASE_S * 1000)}], got {lease_ms}")
    return lease_s


class GrantTable:
    """Runs on the event loop. `on_end(grant, outcome)` posts the grant's events (it must not raise)."""

    def __init__(self, on_end: Callable[[Grant, str], None], *, max_grants: int = MAX_GRANTS,
                 max_blocks: int = MAX_GRANTED_BLOCKS) -> None:
        self._grants: dict[bytes, Grant] = {}
        self._draining: dict[bytes, Grant] = {}
        """Released grants whose blocks a peer link still holds (`Grant.holds`): unusable, ended at `expires`."""
        self._on_end = on_end
        self.max_grants = max_grants
        self.max_blocks = max_blocks
        self.covered_blocks = 0
        """Blocks of every live or draining grant (bounded by `max_blocks`)."""
        self._sweeper: asyncio.Task[None] | None = None
        self.ended: dict[str, int] = {}
        """Grants ended so far, by outcome (for metrics and tests)."""
        self.redeemed = 0
        """Redemptions answered so far (a peer's pull that could not use a renewal's answer; for metrics and tests)."""

    def __len__(self) -> int:
        return len(self._grants)

    # -- the holder's operations ---------------------------------------------------------------------------------
    def create(self, cache_ids: Sequence[int], blocks: Sequence[int], lease_ms: int, max_hold_ms: int, label: str,
               event_topics: Sequence[str], num_blocks_of: Callable[[int], int], units_per_block: int = 1,
               view_cache_ids: Sequence[int] = (), view_units_per_block: int = 1,
               traceparent: str = "") -> tuple[Grant, bytes]:
        """`num_blocks_of(cache_id)`: the cache's block count (fails for an unknown cache). `view_cache_ids`: the
        same blocks in these caches too, in units of `view_units_per_block`. `traceparent`: the span the grant is
        made under (made by this daemon's tracing: valid and 55 characters), for pulls to link to."""
        units, view_units = units_per_block or 1, view_units_per_block or 1
        for name, value in (("units_per_block", units_per_block), ("view_units_per_block", view_units_per_block)):
            if not 0 <= value <= MAX_UNITS_PER_BLOCK:
                param_invalid(f"{name} must be in [0, {MAX_UNITS_PER_BLOCK}], got {value}")
        self.sweep()
        if not 1 <= len(cache_ids) <= MAX_CACHES - len(view_cache_ids):
            param_invalid(f"a grant covers 1..{MAX_CACHES} caches, got {len(cache_ids) + len(view_cache_ids)}")
        if len({*cache_ids, *view_cache_ids}) != len(cache_ids) + len(view_cache_ids):
            param_invalid("cache_ids and view_cache_ids repeat a cache")
        if not 1 <= len(blocks) <= MAX_BLOCKS:
            param_invalid(f"a grant covers 1..{MAX_BLOCKS} blocks, got {len(blocks)}")
        block_list = _block_array(blocks)
        if len(set(block_list)) != len(block_list):
            param_invalid("blocks repeat a block")
        top = max(block_list)
        for cache_id, each in [(c, units) for c in cache_ids] + [(c, view_units) for c in view_cache_ids]:
            if (top + 1) * each > (n := num_blocks_of(cache_id)):
                param_invalid(f"block {top} (of {each} blocks each) is out of range for cache {cache_id} ({n} blocks)")
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
        if self.covered_blocks + len(block_list) > self.max_blocks:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"grants cover {self.covered_blocks} blocks; {len(block_list)} more "
                 f"would pass max_granted_blocks={self.max_blocks}: release grants first")
        grant_id, secret = secrets.token_bytes(ID_BYTES), secrets.token_bytes(SECRET_BYTES)
        now = time.monotonic()
        grant = Grant(grant_id, _digest(secret), tuple(int(c) for c in cache_ids), block_list, lease_s,
                      now + lease_s, now + hold_s, label, tuple(event_topics), units,
                      tuple(int(c) for c in view_cache_ids), view_units, traceparent)
        self._grants[grant_id] = grant
        self.covered_blocks += len(block_list)
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

    def redeem(self, grant_id: bytes, secret: bytes, hold_ms: int, by: object = None) -> Grant:
        """The grant, its lease extended to at least `hold_ms` (within its cap), and its blocks held for link `by`
        as long: a pull that began in time never reads blocks that were freed under it. The answer's
        `expires_in_ms` says when the grant ends at the latest; the puller refuses one that ends before its pull."""
        grant = self.get(grant_id, secret)
        now = time.monotonic()
        until = min(grant.cap, now + min(hold_ms / 1000, MAX_REDEEM_HOLD_S))
        if by is not None and not self._hold(grant, by, until, now):
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{MAX_HOLDERS} links read this grant already; retry later")
        self.redeemed += 1
        grant.expires = max(grant.expires, until)
        return grant

    def promise(self, grant: Grant, to: object) -> bool:
        """Holds the blocks for `to` (a peer's link) until the grant's current `expires`, which a renewal's answer
        tells it; False when too many links hold the grant already (then `to` must not be told)."""
        return self._hold(grant, to, grant.expires, time.monotonic())

    def _hold(self, grant: Grant, by: object, until: float, now: float) -> bool:
        for key in [k for k, t in grant.holds.items() if t <= now]:
            del grant.holds[key]
        if by not in grant.holds and len(grant.holds) >= MAX_HOLDERS:
            return False
        grant.holds[by] = max(grant.holds.get(by, 0.0), until)
        return True

    def release(self, grant_id: bytes, secret: bytes, by: object = None, hold_s: float = 0.0) -> None:
        """Ends the grant at once for every use; its blocks are freed (its event posted) when no link holds them
        any more. `by`: the peer link the release came through (None: a local client), whose pulls by the grant
        still read for `hold_s` (its own word replaces what it held: it knows its pulls; every other link's holds
        stand, whoever releases)."""
        grant = self.get(grant_id, secret)
        now = time.monotonic()
        if by is not None:
            grant.holds.pop(by, None)
            if hold_s > 0:
                grant.holds[by] = min(grant.cap, now + min(hold_s, MAX_REDEEM_HOLD_S))
        until = max(grant.holds.values(), default=now)
        if until <= now:
            self._end(grant, "released")
            return
        del self._grants[grant.grant_id]
        grant.expires = grant.cap = until
        self._draining[grant.grant_id] = grant

    # -- ends the holder did not ask for ------------------------------------------------------------------------
    def cache_removed(self, cache_id: int) -> None:
        for grant in [g for g in self._grants.values() if cache_id in g.cache_ids or cache_id in g.view_cache_ids]:
            self._end(grant, "cache removed")
        for grant in [g for g in self._draining.values() if cache_id in g.cache_ids or cache_id in g.view_cache_ids]:
            self._drained(grant)

    def sweep(self) -> None:
        now = time.monotonic()
        for grant in [g for g in self._grants.values() if g.expires <= now]:
            self._end(grant, "capped" if grant.expires >= grant.cap else "lapsed")
        for grant in [g for g in self._draining.values() if g.expires <= now]:
            self._drained(grant)

    def _drained(self, grant: Grant) -> None:
        """A released grant's last hold is over (or its cache gone): its blocks are freed now."""
        if self._draining.pop(grant.grant_id, None) is not None:
            self._grants[grant.grant_id] = grant
            self._end(grant, "released")

    def forgive_stall(self, stalled_s: float) -> None:
        """The daemon did not run for `stalled_s`: no renewal could be heard, so that time does not count."""
        for grant in [*self._grants.values(), *self._draining.values()]:
            grant.expires += stalled_s
            grant.cap += stalled_s
            for key in grant.holds:
                grant.holds[key] += stalled_s

    def _end(self, grant: Grant, outcome: str) -> None:
        if self._grants.pop(grant.grant_id, None) is None:
            return
        self.covered_blocks -= len(grant.blocks)
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
