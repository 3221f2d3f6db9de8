"""`kvbroker.v1.Peer`: what linked daemons ask of us (handshake, cache lookups, heartbeats, unlink notices,
notifications). Every call but the handshake's first step must carry a valid LinkProof."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import grpc.aio
from google.protobuf.message import Message

from kvbroker.convert import desc_to_pb, tensor_location_to_pb
from kvbroker.v1 import peer_pb2, peer_pb2_grpc
from kvbrokerd.errors import LlmError, LlmStatus, fail
from kvbrokerd.links import linkauth
from kvbrokerd.links.inbound import InboundLink, seal, source_host
from kvbrokerd.links.table import PROTOCOL_VERSION
from kvbrokerd.node import Node
from kvbrokerd.service.errors import llm_errors
from kvbrokerd.tls import certified_cluster_ids

MAX_PENDING_LOOKUPS = 256
"""GetCacheInfo calls under way at once, over all links (a lookup may wait for a backend to register the cache)."""
MAX_PENDING_LOOKUPS_PER_LINK = 32
"""GetCacheInfo calls one link may have under way: a peer that keeps lookups pending holds up only its own."""


class PeerService(peer_pb2_grpc.PeerServicer):
    def __init__(self, node: Node) -> None:
        self.node = node
        self._lookups: dict[InboundLink, int] = {}  # pending GetCacheInfo calls by link
        self._pending = 0

    @contextlib.contextmanager
    def _lookup(self, link: InboundLink) -> Iterator[None]:
        """Counts a pending lookup against its link's share and the whole (LLM_LINK_BUSY past either: try again)."""
        mine = self._lookups.get(link, 0)
        if mine >= MAX_PENDING_LOOKUPS_PER_LINK:
            fail(LlmStatus.LLM_LINK_BUSY, f"this link has {mine} cache lookups under way, the most one link may")
        if self._pending >= MAX_PENDING_LOOKUPS:
            fail(LlmStatus.LLM_LINK_BUSY, f"{self._pending} cache lookups are under way, the most this daemon runs")
        self._lookups[link] = mine + 1
        self._pending += 1
        try:
            yield
        finally:
            self._pending -= 1
            self._lookups[link] -= 1
            if not self._lookups[link]:
                del self._lookups[link]

    @llm_errors
    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
                        ) -> peer_pb2.HandshakeResponse:
        return self.node.links.inbound.hello(request)

    @llm_errors
    async def Authenticate(self, request: peer_pb2.AuthenticateRequest, context: grpc.aio.ServicerContext
                           ) -> peer_pb2.AuthenticateResponse:
        n = self.node
        link = n.links.inbound.authenticate(request, source_host(context.peer()),
                                            certified_cluster_ids(context.auth_context()))
        answer = peer_pb2.AuthenticateResponse(
            cluster_id=n.cluster_id, instance_epoch=n.epoch,
            backend_info={name: b.advertise() for name, b in n.links.backends.items()})
        # Sealed with the new link's secret, which only the caller that passed the handshake can derive: a relay that
        # passed the proofs along cannot rewrite where our data plane is (seq 0: no call has used the link yet).
        seal(answer, "Authenticate", link.secret, linkauth.link_id(link.secret), 0)
        return answer

    @llm_errors
    async def GetCacheInfo(self, request: peer_pb2.GetCacheInfoRequest, context: grpc.aio.ServicerContext
                           ) -> peer_pb2.GetCacheInfoResponse:
        link = self.node.links.inbound.authorize("GetCacheInfo", request, request.proof)
        # Pinned while backends describe it: an engine may still be registering its memory when the cache is
        # removed, and must not see it unmapped (or keep a registration the removal never learned of).
        with self._lookup(link), self.node.registry.pinned(request.cache_id) as entry:
            backend_info = {name: info for name, b in self.node.links.backends.items()
                            if (info := await b.describe_cache(entry))}
        return _sealed(peer_pb2.GetCacheInfoResponse(
            cache_id=entry.cache_id, desc=desc_to_pb(entry.desc),
            tensors=[tensor_location_to_pb(t) for t in entry.tensors], instance_epoch=self.node.epoch,
            backend_info=backend_info,
        ), "GetCacheInfo", link, request.proof)

    @llm_errors
    async def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> peer_pb2.HeartbeatResponse:
        try:
            self.node.links.inbound.authorize("Heartbeat", request, request.proof)
        except LlmError:
            return peer_pb2.HeartbeatResponse(link_known=False)  # a stranger learns nothing, not even our epoch
        return peer_pb2.HeartbeatResponse(instance_epoch=self.node.epoch, link_known=True)

    @llm_errors
    async def Unlink(self, request: peer_pb2.PeerUnlinkRequest, context: grpc.aio.ServicerContext
                     ) -> peer_pb2.PeerUnlinkResponse:
        link = self.node.links.inbound.authorize("Unlink", request, request.proof)
        self.node.links.inbound.drop(link)
        return peer_pb2.PeerUnlinkResponse()

    @llm_errors
    async def Notify(self, request: peer_pb2.PeerNotifyRequest, context: grpc.aio.ServicerContext
                     ) -> peer_pb2.PeerNotifyResponse:
        link = self.node.links.inbound.authorize("Notify", request, request.proof)
        # Charged to the network the link came from (as link shares are), not to the cluster id it claims.
        self.node.notifications.put(link.remote_cluster_id, request.topic, bytes(request.payload),
                                    source=link.network or link.source)
        return peer_pb2.PeerNotifyResponse()

    @llm_errors
    async def RedeemGrant(self, request: peer_pb2.RedeemGrantRequest, context: grpc.aio.ServicerContext
                          ) -> peer_pb2.RedeemGrantResponse:
        link = self.node.links.inbound.authorize("RedeemGrant", request, request.proof)
        grant = self.node.grants.redeem(request.grant_id, request.secret, request.hold_ms, by=link)
        return _sealed(peer_pb2.RedeemGrantResponse(
            cache_ids=grant.cache_ids, blocks=grant.blocks, expires_in_ms=grant.expires_in_ms(),
            units_per_block=grant.units_per_block, traceparent=grant.traceparent,
            view_cache_ids=grant.view_cache_ids, view_units_per_block=grant.view_units_per_block,
            instance_epoch=self.node.epoch), "RedeemGrant", link, request.proof)

    @llm_errors
    async def RenewGrant(self, request: peer_pb2.PeerRenewGrantRequest, context: grpc.aio.ServicerContext
                         ) -> peer_pb2.PeerRenewGrantResponse:
        link = self.node.links.inbound.authorize("RenewGrant", request, request.proof)
        table = self.node.grants
        grant = table.renew(request.grant_id, request.secret, request.lease_ms)
        answer = peer_pb2.PeerRenewGrantResponse(expires_in_ms=grant.expires_in_ms())
        if table.promise(grant, link):
            # What a redemption would say rides along: a caller that renews while its request waits can then pull
            # without redeeming first (links/grantcache.py); the blocks stay ours until the lease stated here ends,
            # whoever releases the grant (GrantTable.release).
            answer.cache_ids[:], answer.blocks[:] = grant.cache_ids, grant.blocks
            answer.units_per_block, answer.instance_epoch = grant.units_per_block, self.node.epoch
            answer.traceparent = grant.traceparent
            answer.view_cache_ids[:], answer.view_units_per_block = grant.view_cache_ids, grant.view_units_per_block
        return _sealed(answer, "RenewGrant", link, request.proof)

    @llm_errors
    async def ReleaseGrant(self, request: peer_pb2.PeerReleaseGrantRequest, context: grpc.aio.ServicerContext
                           ) -> peer_pb2.PeerReleaseGrantResponse:
        link = self.node.links.inbound.authorize("ReleaseGrant", request, request.proof)
        self.node.grants.release(request.grant_id, request.secret, by=link, hold_s=request.hold_ms / 1000)
        return _sealed(peer_pb2.PeerReleaseGrantResponse(), "ReleaseGrant", link, request.proof)


_Answer = TypeVar("_Answer", bound=Message)


def _sealed(answer: _Answer, method: str, link: InboundLink, proof: peer_pb2.LinkProof) -> _Answer:
    seal(answer, method, link.secret, bytes(proof.link_id), proof.seq)
    return answer


__all__ = ["PROTOCOL_VERSION", "PeerService"]
