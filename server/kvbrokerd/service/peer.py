"""`kvbroker.v1.Peer`: what linked daemons ask of us (handshake, cache lookups, heartbeats, unlink notices)."""

from __future__ import annotations

import grpc.aio

from kvbroker._convert import desc_to_pb, tensor_location_to_pb
from kvbroker.v1 import peer_pb2, peer_pb2_grpc
from kvbrokerd.errors import LlmError
from kvbrokerd.links import PROTOCOL_VERSION
from kvbrokerd.node import Node
from kvbrokerd.service.errors import llm_errors


class PeerService(peer_pb2_grpc.PeerServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @llm_errors
    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
                        ) -> peer_pb2.HandshakeResponse:
        n = self.node
        token = n.links.accept(request)
        return peer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION, cluster_id=n.cluster_id, instance_epoch=n.epoch,
            backends=list(n.backends), data_address=n.data_address, link_token=token,
            shm_probe_path=str(n.registry.control_path or ""), shm_probe_nonce=n.registry.nonce,
        )

    @llm_errors
    async def GetCacheInfo(self, request: peer_pb2.GetCacheInfoRequest, context: grpc.aio.ServicerContext
                           ) -> peer_pb2.GetCacheInfoResponse:
        self.node.links.authorize(request.link_token)
        entry = self.node.registry.get(request.cache_id)
        return peer_pb2.GetCacheInfoResponse(
            cache_id=entry.cache_id, desc=desc_to_pb(entry.desc),
            tensors=[tensor_location_to_pb(t) for t in entry.tensors],
            shm_dir=str(self.node.registry.shm_dir), instance_epoch=self.node.epoch,
        )

    @llm_errors
    async def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> peer_pb2.HeartbeatResponse:
        try:
            self.node.links.authorize(request.link_token)
            known = True
        except LlmError:
            known = False
        return peer_pb2.HeartbeatResponse(instance_epoch=self.node.epoch, link_known=known)

    @llm_errors
    async def Unlink(self, request: peer_pb2.PeerUnlinkRequest, context: grpc.aio.ServicerContext
                     ) -> peer_pb2.PeerUnlinkResponse:
        self.node.links.authorize(request.link_token)
        self.node.links.drop_inbound(request.link_token)
        return peer_pb2.PeerUnlinkResponse()
