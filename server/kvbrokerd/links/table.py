"""The link table: outbound links (we dialled a peer and may transfer with it) and inbound ones (a peer dialled us;
see inbound.py).

A link is made by the two-step authenticated handshake of linkauth.py (`Peer.Handshake`, then `Peer.Authenticate`),
which checks the protocol version, both cluster ids and the deployment token, then picks the first backend of our
`--backends` order that both sides can use (`shm` only after the probe proves shared memory). Heartbeats watch each
outbound link: a silent peer or a new peer incarnation moves it to BROKEN. What a peer answers is untrusted: a
malformed answer fails that link with LLM_LINK_FAILED and the reason.

Links reclaim themselves, because a fleet client cannot know which of its peers died: a link BROKEN for
`--broken-link-ttl` (or, if `--idle-link-ttl` is set, READY but unused that long) is removed, its channel closed, its
peer's caches forgotten and its heartbeats stopped; and a new link never finds the table full while a BROKEN link
holds a slot: the one BROKEN the longest gives way. Each removal is logged and counted by reason (`reclaimed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvbroker.convert import desc_from_pb
from kvbroker.status import make_error, read_failure
from kvbroker.types import DeviceMemory, LinkState, TensorLocation
from kvbroker.v1 import peer_pb2, peer_pb2_grpc
from kvbrokerd.dataplane.seam import (
    MAX_ADVERTISEMENT_BYTES,
    Backend,
    BackendUnusable,
    PeerChannel,
    PeerInfo,
    RemoteCache,
)
from kvbrokerd.errors import LlmError, LlmStatus, fail
from kvbrokerd.links import linkauth
from kvbrokerd.links.grantcache import HOLD_MARGIN_S, SAFETY_S, GrantCache, GrantReaders
from kvbrokerd.links.inbound import (
    MAX_EPOCH_BYTES,
    PROTOCOL_VERSION,
    InboundLink,
    InboundShares,
    InboundTable,
    answer_ok,
    sign,
)
from kvbrokerd.links.peeraddress import dial_target

log = logging.getLogger(__name__)

MAX_LINKS = 1024
MAX_PEER_ANSWER_BYTES = 16 << 20
"""Largest answer we accept from a peer (a cache description of 4096 tensors is well under 1 MiB)."""
_PEER_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_PEER_ANSWER_BYTES)]
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_MISSES = 3
BROKEN_LINK_TTL_S = 60.0
IDLE_LINK_TTL_S = 0.0
"""0: a READY link is kept however long it goes unused (its peer is alive; only its client knows if it is wanted)."""


@dataclass(eq=False)
class Link:
    remote_cluster_id: int
    remote_address: str
    state: LinkState = LinkState.LINKING
    remote_epoch: str = ""
    secret: bytes = b""
    backend: str = ""
    channel: PeerChannel | None = None
    grpc_channel: grpc.aio.Channel | None = None
    stub: peer_pb2_grpc.PeerStub | None = None
    last_seen: float = 0.0
    reason: str = ""
    remote_caches: dict[int, RemoteCache] = field(default_factory=dict)
    _lookups: dict[int, asyncio.Future[RemoteCache]] = field(default_factory=dict)
    final: bool = False
    broken_since: float = 0.0
    """time.monotonic() when the link last turned BROKEN (meaningful while it is BROKEN)."""
    last_used: float = field(default_factory=time.monotonic)
    """time.monotonic() of the last transfer, lookup or notification over the link (or of its making)."""
    busy: int = 0
    """Transfers running over the link now (an idle link is one with none)."""
    heartbeat: asyncio.Task[None] | None = None
    grants: GrantCache = field(default_factory=GrantCache)
    """What the peer said about the grants we renewed on it (grantcache.py)."""
    readers: GrantReaders = field(default_factory=GrantReaders)
    """Our pulls by the peer's grants that may still read its blocks (a release we send says how long)."""
    grant_answers: Counter[str] = field(default_factory=Counter)
    """Pulls by grant answered from `grants` ("remembered") or by a RedeemGrant call ("redeemed"); the link table
    passes its own counter, so that the counts outlive the link."""
    renewing: dict[bytes, asyncio.Event] = field(default_factory=dict)
    """Grants whose renewal is on its way to the peer: a pull by one waits for the answer instead of redeeming."""
    waiting_on_renewals: int = 0
    """Pulls waiting for a renewal's answer now."""
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def signed(self, method: str, request: Message) -> Message:
        sign(request, method, self.secret, linkauth.link_id(self.secret), next(self._seq))
        return request

    def check_answer(self, answer: Message, method: str, request: Message) -> None:
        """The peer's answer must carry its MAC under our link's secret, bound to this call: anything else came
        from a relay (or a peer that does not speak protocol 3), and is refused before any of it is used."""
        proof = request.proof  # type: ignore[attr-defined]
        if not answer_ok(answer, method, self.secret, bytes(proof.link_id), proof.seq):
            fail(LlmStatus.LLM_LINK_FAILED, f"cluster {self.remote_cluster_id}'s answer to {method} failed "
                 "authentication (a relay rewrote it?)")

    async def granted(self, grant_id: bytes, secret: bytes, hold_s: float, timeout: float
                      ) -> tuple[peer_pb2.RedeemGrantResponse, float]:
        """What `redeem_grant` answers, without the round trip when a renewal told us and the grant surely lives
        `hold_s` more (see grantcache.py for why that is safe); and until when (time.monotonic()) the grant, and so
        its blocks, surely live: a pull must stop reading by then."""
        known = self.grants.lookup(grant_id, secret, hold_s)
        if known is None and (renewal := self.renewing.get(grant_id)) is not None:
            # A decode engine pulls a request as soon as it is scheduled, usually while the first renewal of its grant
            # (sent when the request arrived) is still on its way: its answer is as good as a redeem's, and is coming.
            started = time.monotonic()
            self.waiting_on_renewals += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(renewal.wait(), timeout)
            finally:
                self.waiting_on_renewals -= 1
            timeout = max(0.001, timeout - (time.monotonic() - started))
            known = self.grants.lookup(grant_id, secret, hold_s)
        if known is None:
            return await self.redeem_grant(grant_id, secret, hold_s, timeout)
        self.grant_answers["remembered"] += 1
        return peer_pb2.RedeemGrantResponse(cache_ids=known.cache_ids, blocks=known.blocks,
                                            units_per_block=known.units_per_block, traceparent=known.traceparent,
                                            view_cache_ids=known.view_cache_ids,
                                            view_units_per_block=known.view_units_per_block,
                                            instance_epoch=self.remote_epoch), known.good_until

    async def redeem_grant(self, grant_id: bytes, secret: bytes, hold_s: float, timeout: float
                           ) -> tuple[peer_pb2.RedeemGrantResponse, float]:
        """The caches and blocks a grant covers, from the daemon that made it (which keeps it alive, and its blocks
        held for us, for `hold_s` within the grant's cap), and until when the grant surely lives: the answer's lease,
        counted from when we sent the call (the peer counted from later), less SAFETY_S."""
        assert self.stub is not None
        self.grant_answers["redeemed"] += 1
        req = self.signed("RedeemGrant", peer_pb2.RedeemGrantRequest(
            grant_id=grant_id, secret=secret, hold_ms=max(0, min(600_000, int(hold_s * 1000)))))
        sent_at = time.monotonic()
        try:
            resp = await self.stub.RedeemGrant(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self.grants.forget(grant_id, secret)
            raise peer_error(e, self.remote_cluster_id, "the grant") from None
        self.check_answer(resp, "RedeemGrant", req)
        answer: peer_pb2.RedeemGrantResponse = resp
        if answer.instance_epoch != self.remote_epoch:
            self.mark_broken("the peer restarted (new instance epoch)", final=True)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"cluster {self.remote_cluster_id} restarted; the grant belonged "
                 "to its previous incarnation")
        # Not remembered: the peer promises its blocks to a link only in a renewal's answer (GrantTable.promise).
        return answer, sent_at + answer.expires_in_ms / 1000 - SAFETY_S

    async def renew_grant(self, grant_id: bytes, secret: bytes, lease_ms: int, timeout: float) -> int:
        """Milliseconds until the grant lapses, as the daemon that made it says; what the answer says the grant
        covers is remembered for our pulls by it (a failed renewal forgets it)."""
        assert self.stub is not None
        req = self.signed("RenewGrant", peer_pb2.PeerRenewGrantRequest(grant_id=grant_id, secret=secret,
                                                                       lease_ms=lease_ms))
        ticket, sent_at = self.grants.asking(grant_id), time.monotonic()
        renewal = self.renewing.setdefault(grant_id, asyncio.Event())
        try:
            try:
                resp = await self.stub.RenewGrant(req, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                self.grants.forget(grant_id, secret)
                raise peer_error(e, self.remote_cluster_id, "the grant") from None
            self.check_answer(resp, "RenewGrant", req)
            if resp.instance_epoch == self.remote_epoch:  # an older peer sends neither: nothing is remembered
                self.grants.remember(ticket, grant_id, secret, resp.cache_ids, resp.blocks,
                                     resp.units_per_block, sent_at, resp.expires_in_ms, resp.traceparent,
                                     view_cache_ids=resp.view_cache_ids, view_units_per_block=resp.view_units_per_block)
            return int(resp.expires_in_ms)
        finally:
            if self.renewing.get(grant_id) is renewal:
                del self.renewing[grant_id]
            renewal.set()

    async def release_grant(self, grant_id: bytes, secret: bytes, timeout: float) -> None:
        """Ends the grant; the peer keeps its blocks while our pulls by it may still read them (`readers`)."""
        assert self.stub is not None
        self.grants.forget(grant_id, secret)  # first: a release that fails on its way may still have ended the grant
        hold_ms = math.ceil(self.readers.hold_s(grant_id) * 1000)
        if hold_ms:
            hold_ms = min(600_000, hold_ms + int(HOLD_MARGIN_S * 1000))
        req = self.signed("ReleaseGrant", peer_pb2.PeerReleaseGrantRequest(grant_id=grant_id, secret=secret,
                                                                           hold_ms=hold_ms))
        try:
            resp = await self.stub.ReleaseGrant(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise peer_error(e, self.remote_cluster_id, "the grant") from None
        self.check_answer(resp, "ReleaseGrant", req)

    async def notify(self, topic: str, payload: bytes, timeout: float) -> None:
        assert self.stub is not None
        req = self.signed("Notify", peer_pb2.PeerNotifyRequest(topic=topic, payload=payload))
        try:
            await self.stub.Notify(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise peer_error(e, self.remote_cluster_id, "the notification") from None

    async def remote_cache(self, cache_id: int, timeout: float) -> RemoteCache:
        """The peer's description of `cache_id`, fetched once per link (ids are never reused by a daemon).
        Concurrent first transfers of a cache share one lookup, hence one RemoteCache: its identity keys the locks
        that keep two writes out of the same blocks (blocklocks.py), so two copies of it would let them tear."""
        deadline = time.monotonic() + timeout
        while (cached := self.remote_caches.get(cache_id)) is None:
            lookup = self._lookups.get(cache_id)
            mine = lookup is None
            if lookup is None:
                lookup = self._lookups[cache_id] = asyncio.ensure_future(
                    self._look_up(cache_id, max(0.001, deadline - time.monotonic())))
                lookup.add_done_callback(lambda done: self._looked_up(cache_id, done))
            # Each caller waits within its own deadline; one that gives up does not cancel the others' lookup.
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    return await asyncio.shield(lookup)
            except TimeoutError:
                fail(LlmStatus.LLM_TIMEOUT, f"cluster {self.remote_cluster_id} did not answer the lookup of cache "
                     f"{cache_id} in time")
            except LlmError as e:
                # Another caller's lookup ran out of *its* time: ours is not over, so ask again.
                if mine or e.status != LlmStatus.LLM_TIMEOUT or time.monotonic() >= deadline:
                    raise
        return cached

    def _looked_up(self, cache_id: int, done: asyncio.Future[RemoteCache]) -> None:
        if self._lookups.get(cache_id) is done:
            del self._lookups[cache_id]
        if not done.cancelled():
            done.exception()  # retrieved: callers that all gave up leave no "never retrieved" warning

    async def _look_up(self, cache_id: int, timeout: float) -> RemoteCache:
        assert self.stub is not None
        req = self.signed("GetCacheInfo", peer_pb2.GetCacheInfoRequest(cache_id=cache_id))
        try:
            resp = await self.stub.GetCacheInfo(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise peer_error(e, self.remote_cluster_id, f"the lookup of cache {cache_id}") from None
        self.check_answer(resp, "GetCacheInfo", req)
        if resp.instance_epoch != self.remote_epoch:
            self.mark_broken("the peer restarted (new instance epoch)", final=True)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"cluster {self.remote_cluster_id} restarted; cache {cache_id} "
                 "belonged to its previous incarnation")
        remote = self._parse_cache(cache_id, resp)
        self.remote_caches[cache_id] = remote
        return remote

    def _parse_cache(self, cache_id: int, resp: peer_pb2.GetCacheInfoResponse) -> RemoteCache:
        """The peer's description, checked like any untrusted input: a bad one fails this lookup, not the daemon."""
        try:
            desc = desc_from_pb(resp.desc)
            # A device tensor keeps its kind (which backends can move it) and never a handle: nothing a peer sends
            # is ever imported, only memory that a local client registered is.
            tensors = tuple(TensorLocation(t.segment, t.offset, DeviceMemory(t.device.kind[:16], "", b"", 0)
                                           if t.HasField("device") else None) for t in resp.tensors)
            if resp.cache_id != cache_id or len(tensors) != desc.num_tensors or desc.num_tensors < 1 or \
                    not desc.shape or min(desc.shape) < 1 or any(t.offset < 0 for t in tensors):
                raise ValueError("inconsistent cache description")
        except (ValueError, TypeError, OverflowError) as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"cluster {self.remote_cluster_id} described cache {cache_id} "
                 f"unusably: {e}")
        # Segment names are resolved in OUR shm dir: a peer never names a path on this host.
        info = {name: bytes(v) for name, v in resp.backend_info.items() if len(v) <= MAX_ADVERTISEMENT_BYTES}
        return RemoteCache(cache_id=cache_id, desc=desc, tensors=tensors,
                           backend_info=info)

    def forget_cache(self, cache_id: int) -> None:
        remote = self.remote_caches.pop(cache_id, None)
        if remote is not None and self.channel is not None:
            self.channel.forget(remote)

    def sweep(self) -> None:
        """Forgets the caches that the channel knows are gone on the peer (their mappings with them)."""
        if self.channel is None:
            return
        for cache_id, remote in list(self.remote_caches.items()):
            if self.channel.gone(remote):
                self.forget_cache(cache_id)

    def mark_broken(self, reason: str, *, final: bool = False) -> None:
        """`final`: the peer restarted or dropped the link, so only unlink + link (or auto re-link) repairs it;
        otherwise (a failed transfer, missed heartbeats) the next good heartbeat makes the link READY again."""
        if self.state != LinkState.BROKEN:
            log.warning("link to cluster %d is BROKEN: %s", self.remote_cluster_id, reason)
            self.broken_since = time.monotonic()
        self.state = LinkState.BROKEN
        self.reason = reason
        self.grants.clear()  # whatever broke it, nothing the peer said before is used again
        self.final = final or self.final

    async def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.heartbeat
        if self.channel is not None:
            for remote in self.remote_caches.values():
                self.channel.forget(remote)
            self.channel.close()
        self.remote_caches.clear()
        self.grants.clear()
        if self.grpc_channel is not None:
            await self.grpc_channel.close()


PEER_FORGOT_LINK = "peer_forgot_link"
"""Set (to "true") in the details of a `peer_error` whose peer no longer knows the link it was called on."""


def peer_error(e: grpc.aio.AioRpcError, cluster_id: int, what: str, *, linking: bool = False) -> LlmError:
    """The one decoder for a failed call to a peer's daemon: what the peer answered (code, message, LLM status),
    as the error this daemon reports for `what`. The peer's answer is untrusted: it can fail this call (with the
    peer's status in details["peer_status"]), never pass its status off as ours.

    While `linking`, every failure is LLM_LINK_FAILED (the link could not be made). Otherwise: no answer in time is
    LLM_TIMEOUT; an unknown cache (NOT_FOUND) is LLM_KV_CACHE_NOT_EXIST; a link the peer no longer knows
    (FAILED_PRECONDITION) is LLM_LINK_FAILED with details[PEER_FORGOT_LINK]; a full peer (RESOURCE_EXHAUSTED with
    LLM_OUT_OF_MEMORY) is LLM_OUT_OF_MEMORY, which only says "retry later"; anything else is LLM_LINK_FAILED."""
    answer = read_failure(e)
    details = {"cluster_id": str(cluster_id), "peer_grpc_code": answer.code.name}
    if answer.status is not None:
        details["peer_status"] = answer.status.name
    if linking:
        return make_error(LlmStatus.LLM_LINK_FAILED, f"{what} refused: {answer.text or answer.code.name}", details)
    if answer.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return make_error(LlmStatus.LLM_TIMEOUT, f"cluster {cluster_id} did not answer {what} in time", details)
    if answer.code == grpc.StatusCode.NOT_FOUND:
        return make_error(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{what} on cluster {cluster_id}: {answer.message}",
                          details)
    if answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED and answer.status == LlmStatus.LLM_OUT_OF_MEMORY:
        # The peer is full (its notification cap, its transfer limits): a retry later can work, the link is fine.
        return make_error(LlmStatus.LLM_OUT_OF_MEMORY, f"cluster {cluster_id} is full ({what}): {answer.message}; "
                          "retry later", details)
    if answer.code == grpc.StatusCode.FAILED_PRECONDITION:
        return make_error(LlmStatus.LLM_LINK_FAILED, f"cluster {cluster_id} no longer knows this link ({what}); "
                          "unlink and link again", {**details, PEER_FORGOT_LINK: "true"})
    return make_error(LlmStatus.LLM_LINK_FAILED, f"{what} on cluster {cluster_id} failed: {answer.code.name} "
                      f"{answer.text}", details)


class LinkTable:
    def __init__(self, cluster_id: int, epoch: str, backends: Mapping[str, Backend], *, token: bytes | None = None,
                 credentials: grpc.ChannelCredentials | None = None, max_links: int = MAX_LINKS,
                 auto_relink: bool = False, inbound_ttl_s: float | None = None,
                 broken_link_ttl_s: float = BROKEN_LINK_TTL_S, idle_link_ttl_s: float = IDLE_LINK_TTL_S,
                 inbound_shares: InboundShares | None = None) -> None:
        """`backends`: this daemon's started backends, in order of preference. `broken_link_ttl_s`,
        `idle_link_ttl_s`: how long a link we made may stay BROKEN, or READY and unused, before it is removed (0:
        for ever). `inbound_shares`: what one peer network or claimed cluster id may hold of the inbound links."""
        self.cluster_id = cluster_id
        self._key = linkauth.token_key(token)
        self._credentials = credentials
        self.max_links = max_links
        self.auto_relink = auto_relink
        self.epoch = epoch
        self.backends = dict(backends)
        self.links: dict[int, Link] = {}
        self.broken_link_ttl_s = broken_link_ttl_s
        self.idle_link_ttl_s = idle_link_ttl_s
        self.reclaimed: Counter[str] = Counter()
        """Outbound links removed by this table, by reason (`broken`, `idle`, `room`), for the metrics."""
        self.grant_answers: Counter[str] = Counter()
        """Pulls by grant over any link, by how they learned the grant ("remembered", "redeemed")."""
        self.recently_reclaimed: dict[int, str] = {}
        """The last reason each recently reclaimed cluster's link was removed for (bounded), so that a call on it
        says why the link is gone rather than only that it is not there."""
        self.on_removed: list[Callable[[int], None]] = []
        """Called with the cluster id of each outbound link removed (unlinked or reclaimed), on the event loop: the
        metrics drop that peer's series."""
        self._closing: set[asyncio.Task[None]] = set()
        self.inbound = InboundTable(cluster_id, self._key, max_links=max_links,
                                    shares=inbound_shares or InboundShares(),
                                    **({} if inbound_ttl_s is None else {"link_ttl_s": inbound_ttl_s}))

    # -- outbound ------------------------------------------------------------------------------------------------
    def get_ready(self, cluster_id: int) -> Link:
        link = self.links.get(cluster_id)
        if link is None or link.state == LinkState.LINKING:
            why = "" if link is not None or cluster_id not in self.recently_reclaimed else \
                f" (its link was removed: {self.recently_reclaimed[cluster_id]})"
            fail(LlmStatus.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked{why}; call LinkClusters first",
                 cluster_id=cluster_id)
        if link.state == LinkState.BROKEN:
            fail(LlmStatus.LLM_LINK_FAILED, f"link to cluster {cluster_id} is BROKEN ({link.reason}); unlink and "
                 "link again", cluster_id=cluster_id)
        link.last_used = time.monotonic()
        return link

    async def link(self, cluster_id: int, address: str, timeout: float) -> Link:
        if cluster_id == self.cluster_id:
            fail(LlmStatus.LLM_PARAM_INVALID, f"cannot link to our own cluster id {cluster_id}")
        if cluster_id in self.links:
            existing = self.links[cluster_id]
            if existing.state == LinkState.LINKING:
                fail(LlmStatus.LLM_PROCESSING_LINK, f"a link to cluster {cluster_id} is being made")
            fail(LlmStatus.LLM_ALREADY_LINK, f"cluster {cluster_id} is already linked ({existing.state.name})")
        if len(self.links) >= self.max_links:
            self._make_room()
        link = self.links[cluster_id] = Link(cluster_id, address, grant_answers=self.grant_answers)
        self.recently_reclaimed.pop(cluster_id, None)
        try:
            await self._handshake(link, timeout)
        except BaseException:
            del self.links[cluster_id]
            await link.close()
            raise
        link.heartbeat = asyncio.create_task(self._heartbeat_loop(link))
        log.info("linked to cluster %d at %s (backend %s)", cluster_id, address, link.backend)
        return link

    def _make_room(self) -> None:
        """Removes the link BROKEN the longest, or refuses: a live link is never dropped for a new one."""
        broken = [link for link in self.links.values() if link.state == LinkState.BROKEN]
        if not broken:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"link limit reached ({self.max_links}) and every link is live; unlink "
                 "some first or raise --max-links")
        self._reclaim(min(broken, key=lambda link: link.broken_since), "room",
                      f"to make room for a new link ({link_reason(broken)})")

    def _reclaim(self, link: Link, reason: str, why: str) -> None:
        """Removes `link` from the table at once (its slot is free when this returns) and frees its resources in the
        background: heartbeats stopped, channel closed, remote caches forgotten."""
        if self.links.get(link.remote_cluster_id) is not link:
            return
        del self.links[link.remote_cluster_id]
        self.reclaimed[reason] += 1
        if len(self.recently_reclaimed) >= self.max_links:
            self.recently_reclaimed.pop(next(iter(self.recently_reclaimed)))
        self.recently_reclaimed[link.remote_cluster_id] = why
        self._removed(link.remote_cluster_id)
        log.warning("link to cluster %d at %s removed (%s): %s", link.remote_cluster_id, link.remote_address,
                    reason, why)
        if link.heartbeat is asyncio.current_task():
            link.heartbeat = None  # the loop reclaiming its own link returns by itself
        task = asyncio.ensure_future(link.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _expired(self, link: Link) -> tuple[str, str] | None:
        """(reason, why) if `link` has outlived --broken-link-ttl or --idle-link-ttl, else None."""
        now = time.monotonic()
        if link.state == LinkState.BROKEN and self.broken_link_ttl_s and \
                now - link.broken_since >= self.broken_link_ttl_s:
            return "broken", f"BROKEN for {self.broken_link_ttl_s:g} s ({link.reason})"
        if link.state == LinkState.READY and self.idle_link_ttl_s and not link.busy and \
                now - link.last_used >= self.idle_link_ttl_s:
            return "idle", f"unused for {self.idle_link_ttl_s:g} s"
        return None

    async def _handshake(self, link: Link, timeout: float) -> None:
        """Both steps of the handshake within `timeout`; any malformed answer is LLM_LINK_FAILED for this link."""
        try:
            async with asyncio.timeout(timeout):
                await self._authenticated_handshake(link, timeout)
        except TimeoutError:
            fail(LlmStatus.LLM_LINK_FAILED, f"cluster {link.remote_cluster_id} at {link.remote_address} did not "
                 f"complete the handshake within {timeout:.3g} s")
        except LlmError:
            raise
        except Exception as e:  # a peer's answer must never surface as an internal error
            log.warning("handshake with cluster %d failed", link.remote_cluster_id, exc_info=True)
            fail(LlmStatus.LLM_LINK_FAILED, f"cluster {link.remote_cluster_id} at {link.remote_address} answered "
                 f"unusably: {type(e).__name__}: {e}")

    async def _authenticated_handshake(self, link: Link, timeout: float) -> None:
        target = dial_target(link.remote_address)
        link.grpc_channel = (
            grpc.aio.insecure_channel(target, options=_PEER_CHANNEL_OPTIONS) if self._credentials is None
            else grpc.aio.secure_channel(target, self._credentials, options=_PEER_CHANNEL_OPTIONS))
        link.stub = peer_pb2_grpc.PeerStub(link.grpc_channel)
        where = f"cluster {link.remote_cluster_id} at {link.remote_address}"
        hello = peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, cluster_id=self.cluster_id,
                                          instance_epoch=self.epoch, expected_cluster_id=link.remote_cluster_id,
                                          caller_nonce=linkauth.new_nonce())
        try:
            challenge = await link.stub.Handshake(hello, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise peer_error(e, link.remote_cluster_id, where, linking=True) from None
        if challenge.protocol_version != PROTOCOL_VERSION:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} speaks peer protocol {challenge.protocol_version}, we speak "
                 f"{PROTOCOL_VERSION}; run the same kvbroker release on both sides")
        bound = linkauth.binding(self.cluster_id, link.remote_cluster_id, self.epoch, hello.caller_nonce,
                                 bytes(challenge.responder_nonce), PROTOCOL_VERSION)
        if not hmac.compare_digest(linkauth.handshake_proof(self._key, b"responder", bound),
                                   bytes(challenge.responder_proof)):
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} failed authentication: it is not cluster "
                 f"{link.remote_cluster_id}, or it does not hold our peer token (both daemons need the same "
                 "--peer-token-file, or both --insecure-peers)")
        auth = peer_pb2.AuthenticateRequest(challenge_id=challenge.challenge_id,
                                            caller_proof=linkauth.handshake_proof(self._key, b"caller", bound))
        try:
            resp = await link.stub.Authenticate(auth, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise peer_error(e, link.remote_cluster_id, where, linking=True) from None
        secret = linkauth.derive_link_secret(self._key, bound)
        if not answer_ok(resp, "Authenticate", secret, linkauth.link_id(secret), 0):
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: its self-description failed authentication (a relay between "
                 "us rewrote it?)")
        if resp.cluster_id != link.remote_cluster_id:
            fail(LlmStatus.LLM_LINK_FAILED, f"{link.remote_address} is cluster {resp.cluster_id}, not "
                 f"{link.remote_cluster_id}")
        if len(resp.instance_epoch.encode()) > MAX_EPOCH_BYTES:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} sent an instance epoch longer than {MAX_EPOCH_BYTES} bytes")
        link.remote_epoch = resp.instance_epoch
        link.secret = secret
        link.channel, link.backend = await self._choose_backend(link, resp)
        link.state = LinkState.READY
        link.last_seen = time.time()

    async def _choose_backend(self, link: Link, resp: peer_pb2.AuthenticateResponse) -> tuple[PeerChannel, str]:
        """The first backend of our order that the peer serves and that can reach it; every other one's reason goes
        into the failure."""
        peer = PeerInfo(link.remote_cluster_id, link.remote_address, link.secret)
        reasons = []
        for name, backend in self.backends.items():
            info = resp.backend_info.get(name)
            if info is None:
                reasons.append(f"{name}: not served by the peer")
                continue
            if len(info) > MAX_ADVERTISEMENT_BYTES:
                reasons.append(f"{name}: advertisement larger than {MAX_ADVERTISEMENT_BYTES} bytes")
                continue
            try:
                return await backend.connect(peer, bytes(info)), name
            except BackendUnusable as e:
                log.info("cluster %d: backend %s unusable (%s); trying the next", link.remote_cluster_id, name, e)
                reasons.append(f"{name}: {e}")
        served = sorted(resp.backend_info)[:16]
        if not set(served) & set(self.backends):
            fail(LlmStatus.LLM_LINK_FAILED, f"no common backend: we allow {list(self.backends)}, cluster "
                 f"{link.remote_cluster_id} serves {served}")
        fail(LlmStatus.LLM_LINK_FAILED, f"no usable backend with cluster {link.remote_cluster_id}: we allow "
             f"{list(self.backends)}, it serves {served} ({'; '.join(reasons)})")

    def _removed(self, cluster_id: int) -> None:
        for hook in self.on_removed:
            try:
                hook(cluster_id)
            except Exception:  # bookkeeping elsewhere must never keep a link in the table
                log.exception("link removal hook failed for cluster %d", cluster_id)

    async def unlink(self, cluster_id: int, force: bool, timeout: float) -> None:
        link = self.links.get(cluster_id)
        if link is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked")
        if link.state == LinkState.LINKING:
            fail(LlmStatus.LLM_PROCESSING_LINK, f"a link to cluster {cluster_id} is being made")
        notified = True
        try:
            assert link.stub is not None
            await link.stub.Unlink(link.signed("Unlink", peer_pb2.PeerUnlinkRequest()), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            err = peer_error(e, cluster_id, "the unlink notice")
            notified = PEER_FORGOT_LINK in err.details  # the peer had already forgotten us
            if not notified and not force:
                fail(LlmStatus.LLM_UNLINK_FAILED, f"cannot tell cluster {cluster_id}: {err.details['peer_grpc_code']}; "
                     "use force to remove our side anyway")
        del self.links[cluster_id]
        self._removed(cluster_id)
        await link.close()
        log.info("unlinked cluster %d%s", cluster_id, "" if notified else " (forced; peer not told)")

    async def _heartbeat_loop(self, link: Link) -> None:
        misses = 0
        assert link.stub is not None
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            expired = self._expired(link)
            if expired is not None:
                if expired[0] == "idle":  # the peer is alive: tell it, so that its slot for us is freed too
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await link.stub.Unlink(link.signed("Unlink", peer_pb2.PeerUnlinkRequest()),
                                               timeout=HEARTBEAT_INTERVAL_S)
                self._reclaim(link, *expired)
                return
            # Even while the peer does not answer (it may have died): what we hold of its memory must not outlive it.
            link.sweep()
            try:
                resp = await link.stub.Heartbeat(link.signed("Heartbeat", peer_pb2.HeartbeatRequest()),
                                                 timeout=HEARTBEAT_INTERVAL_S)
            except grpc.aio.AioRpcError as e:
                misses += 1
                if misses >= HEARTBEAT_MISSES:
                    last = peer_error(e, link.remote_cluster_id, "the heartbeat")
                    link.mark_broken(f"no heartbeat answer {misses} times ({last.details['peer_grpc_code']})")
                continue
            misses = 0
            link.last_seen = time.time()
            if not resp.link_known:
                # The peer restarted (it knows no link of its previous incarnation), expired or removed the link.
                if self.auto_relink and await self._relink(link):
                    continue
                link.mark_broken("the peer restarted or removed this link; unlink and link again", final=True)
            elif resp.instance_epoch != link.remote_epoch:
                if self.auto_relink and await self._relink(link):
                    continue
                link.mark_broken("the peer restarted (new instance epoch); unlink and link again", final=True)
            elif link.state == LinkState.BROKEN and not link.final:
                link.state, link.reason = LinkState.READY, ""
                log.info("link to cluster %d is READY again", link.remote_cluster_id)

    async def _relink(self, link: Link) -> bool:
        """Re-handshakes with a restarted peer in place; caches it described before are forgotten."""
        if link.channel is not None:
            for remote in link.remote_caches.values():
                link.channel.forget(remote)
            link.channel.close()
        link.channel = None
        link.remote_caches.clear()
        link.grants.clear()  # the restarted peer has none of the grants its previous incarnation made
        link.state, link.final = LinkState.LINKING, False
        link._seq = itertools.count(1)
        old_epoch = link.remote_epoch
        try:
            if link.grpc_channel is not None:
                await link.grpc_channel.close()
            await self._handshake(link, timeout=3.0)
        except LlmError as e:
            link.mark_broken(f"the peer restarted and re-linking failed: {e.message}", final=True)
            return False
        log.info("cluster %d %s: re-linked (epoch %s, backend %s)", link.remote_cluster_id,
                 "restarted" if link.remote_epoch != old_epoch else "forgot our link", link.remote_epoch,
                 link.backend)
        return True

    async def close(self) -> None:
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
        for task in list(self._closing):
            with contextlib.suppress(Exception):
                await task
        self.inbound.clear()

    def secret_for(self, lid: bytes) -> bytes | None:
        return self.inbound.secret_for(lid)


def link_reason(broken: list[Link]) -> str:
    """Why the oldest of these BROKEN links broke, for the log line of its removal."""
    oldest = min(broken, key=lambda link: link.broken_since)
    return f"BROKEN for {time.monotonic() - oldest.broken_since:.0f} s: {oldest.reason}"


__all__ = ["PROTOCOL_VERSION", "InboundLink", "Link", "LinkTable", "LlmError"]
