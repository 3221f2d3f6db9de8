"""A hostile-peer kit: speaks the Peer protocol by hand, as a stranger (no token) or as a compromised peer (holding
the deployment token), so tests can send what no honest daemon would."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.message import Message

from kvbroker.v1 import peer_pb2, peer_pb2_grpc
from kvbrokerd.links import linkauth
from kvbrokerd.links.inbound import PROTOCOL_VERSION, sign


def token_of(workdir: Path) -> bytes:
    return linkauth.load_token(Path(workdir) / "peer.token")


@dataclass
class FakePeerLink:
    """A link a test made to a real daemon through its Peer API."""

    secret: bytes
    description: peer_pb2.AuthenticateResponse
    channel: grpc.Channel
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def stub(self) -> peer_pb2_grpc.PeerStub:
        return peer_pb2_grpc.PeerStub(self.channel)

    @property
    def link_id(self) -> bytes:
        return linkauth.link_id(self.secret)

    @property
    def data_port(self) -> int:
        return int(json.loads(self.description.backend_info["tcp"])["port"])

    def signed(self, method: str, request: Message, seq: int | None = None) -> Message:
        sign(request, method, self.secret, self.link_id, next(self._seq) if seq is None else seq)
        return request

    def close(self) -> None:
        self.channel.close()


def hello(cluster_id: int, expected: int, epoch: str = "fake-epoch") -> peer_pb2.HandshakeRequest:
    return peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, cluster_id=cluster_id, instance_epoch=epoch,
                                     expected_cluster_id=expected, caller_nonce=linkauth.new_nonce())


def link_as(address: str, token: bytes | None, cluster_id: int, expected: int, epoch: str = "fake-epoch",
            credentials: grpc.ChannelCredentials | None = None) -> FakePeerLink:
    """Runs both handshake steps against `address` with `token` (None: as a peer of an --insecure-peers daemon, or
    of a mutual-TLS one, presenting `credentials`). Raises grpc.RpcError where the daemon refuses."""
    key = linkauth.token_key(token)
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    stub = peer_pb2_grpc.PeerStub(channel)
    req = hello(cluster_id, expected, epoch)
    challenge = stub.Handshake(req, timeout=5)
    bound = linkauth.binding(cluster_id, expected, epoch, req.caller_nonce, challenge.responder_nonce,
                             PROTOCOL_VERSION)
    resp = stub.Authenticate(peer_pb2.AuthenticateRequest(
        challenge_id=challenge.challenge_id, caller_proof=linkauth.handshake_proof(key, b"caller", bound)), timeout=5)
    return FakePeerLink(linkauth.derive_link_secret(key, bound), resp, channel)


@contextlib.contextmanager
def from_host(target: str, source_ip: str) -> Iterator[str]:
    """An address to dial instead of `target` ("host:port") so that the daemon there sees the calls come from the
    host `source_ip` (on Linux any 127.x.y.z is this machine). Lets one test play peers on several hosts."""
    with SourceRelays(target) as relays:
        yield relays.via(source_ip)


class SourceRelays:
    """TCP relays on loopback that reach `target` from chosen source addresses (loopback answers for all of
    127.0.0.0/8), so that one test can be many hosts to a daemon. A context manager."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="source-relays", daemon=True)
        self._servers: list[asyncio.Server] = []
        self._thread.start()

    def via(self, source: str) -> str:
        """An address on 127.0.0.1 whose connections reach the target from `source`."""
        async def start() -> int:
            server = await asyncio.start_server(functools.partial(self._relay, source), "127.0.0.1", 0)
            self._servers.append(server)
            return int(server.sockets[0].getsockname()[1])

        return f"127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)}"

    async def _relay(self, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target, local_addr=(source, 0))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, upstream_writer), _pump(upstream_reader, writer), return_exceptions=True)

    def __enter__(self) -> SourceRelays:
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


class FakePeer(peer_pb2_grpc.PeerServicer):
    """A compromised peer: holds the deployment token (so it links), then answers whatever the test set in
    `description` and `caches` (by cache id)."""

    def __init__(self, cluster_id: int, token: bytes | None, description: peer_pb2.AuthenticateResponse) -> None:
        from kvbrokerd.links.inbound import InboundTable

        self.cluster_id = cluster_id
        self.description = description
        self.caches: dict[int, peer_pb2.GetCacheInfoResponse] = {}
        self.unsealed = False
        """Answer without MACs, as a relay that rewrote the answers would (it cannot derive the link secret)."""
        self._inbound = InboundTable(cluster_id, linkauth.token_key(token), max_links=16)
        self._server: grpc.Server | None = None
        self.address = ""

    def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.ServicerContext
                  ) -> peer_pb2.HandshakeResponse:
        return self._inbound.hello(request)

    def Authenticate(self, request: peer_pb2.AuthenticateRequest, context: grpc.ServicerContext
                     ) -> peer_pb2.AuthenticateResponse:
        from kvbrokerd.links.inbound import seal

        link = self._inbound.authenticate(request)
        answer = peer_pb2.AuthenticateResponse()
        answer.CopyFrom(self.description)
        if not self.unsealed:
            seal(answer, "Authenticate", link.secret, linkauth.link_id(link.secret), 0)
        return answer

    def GetCacheInfo(self, request: peer_pb2.GetCacheInfoRequest, context: grpc.ServicerContext
                     ) -> peer_pb2.GetCacheInfoResponse:
        from kvbrokerd.links.inbound import seal

        link = self._inbound.authorize("GetCacheInfo", request, request.proof)
        found = self.caches.get(request.cache_id)
        if found is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such cache")
        assert found is not None
        answer = peer_pb2.GetCacheInfoResponse()
        answer.CopyFrom(found)
        if not self.unsealed:
            seal(answer, "GetCacheInfo", link.secret, bytes(request.proof.link_id), request.proof.seq)
        return answer

    def RedeemGrant(self, request: peer_pb2.RedeemGrantRequest, context: grpc.ServicerContext
                    ) -> peer_pb2.RedeemGrantResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, "no such grant")
        raise AssertionError("unreachable")

    def RenewGrant(self, request: peer_pb2.PeerRenewGrantRequest, context: grpc.ServicerContext
                   ) -> peer_pb2.PeerRenewGrantResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, "no such grant")
        raise AssertionError("unreachable")

    def ReleaseGrant(self, request: peer_pb2.PeerReleaseGrantRequest, context: grpc.ServicerContext
                     ) -> peer_pb2.PeerReleaseGrantResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, "no such grant")
        raise AssertionError("unreachable")

    def Unlink(self, request: peer_pb2.PeerUnlinkRequest, context: grpc.ServicerContext
               ) -> peer_pb2.PeerUnlinkResponse:
        return peer_pb2.PeerUnlinkResponse()

    def Notify(self, request: peer_pb2.PeerNotifyRequest, context: grpc.ServicerContext
               ) -> peer_pb2.PeerNotifyResponse:
        return peer_pb2.PeerNotifyResponse()

    def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: grpc.ServicerContext
                  ) -> peer_pb2.HeartbeatResponse:
        return peer_pb2.HeartbeatResponse(instance_epoch=self.description.instance_epoch, link_known=True)

    def __enter__(self) -> FakePeer:
        from concurrent import futures

        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        peer_pb2_grpc.add_PeerServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop(0)
