"""The link table: outbound links (we dialled a peer and may transfer with it) and inbound ones (a peer dialled us;
its link token authorises its data connections and cache lookups).

A link is made by a `Peer.Handshake` that checks the protocol version and both cluster ids, then picks the first
backend of our `--backends` order that both sides can use (`shm` only after the probe proves shared memory).
Heartbeats watch each outbound link: a silent peer or a new peer incarnation moves it to BROKEN.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import grpc
import grpc.aio

from kvbroker._convert import desc_from_pb
from kvbroker._types import LinkState, TensorLocation
from kvbroker.v1 import peer_pb2, peer_pb2_grpc
from kvbrokerd import linkauth
from kvbrokerd.backends import shm as shm_backend
from kvbrokerd.backends import tcp as tcp_backend
from kvbrokerd.backends.base import PeerChannel, RemoteCache
from kvbrokerd.errors import LlmError, LlmStatus, fail

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
"""Peer protocol history: 1 — first version (Handshake, GetCacheInfo, Heartbeat, Unlink; tcp data frames v1)."""
MAX_LINKS = 1024
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_MISSES = 3


@dataclass(eq=False)
class Link:
    remote_cluster_id: int
    remote_address: str
    state: LinkState = LinkState.LINKING
    remote_epoch: str = ""
    token: bytes = b""
    backend: str = ""
    channel: PeerChannel | None = None
    grpc_channel: grpc.aio.Channel | None = None
    stub: peer_pb2_grpc.PeerStub | None = None
    last_seen: float = 0.0
    reason: str = ""
    remote_caches: dict[int, RemoteCache] = field(default_factory=dict)
    final: bool = False
    heartbeat: asyncio.Task[None] | None = None

    async def remote_cache(self, cache_id: int, timeout: float) -> RemoteCache:
        """The peer's description of `cache_id`, fetched once per link (ids are never reused by a daemon)."""
        cached = self.remote_caches.get(cache_id)
        if cached is not None:
            return cached
        assert self.stub is not None
        try:
            resp = await self.stub.GetCacheInfo(
                peer_pb2.GetCacheInfoRequest(link_token=self.token, cache_id=cache_id), timeout=timeout
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST,
                     f"remote cache {cache_id} does not exist on cluster {self.remote_cluster_id}")
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                fail(LlmStatus.LLM_TIMEOUT, f"cluster {self.remote_cluster_id} did not describe cache {cache_id} "
                     "in time")
            fail(LlmStatus.LLM_LINK_FAILED, f"cache lookup on cluster {self.remote_cluster_id} failed: "
                 f"{e.code().name} {e.details()}")
        if resp.instance_epoch != self.remote_epoch:
            self.mark_broken("the peer restarted (new instance epoch)", final=True)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"cluster {self.remote_cluster_id} restarted; cache {cache_id} "
                 "belonged to its previous incarnation")
        remote = RemoteCache(cache_id=cache_id, desc=desc_from_pb(resp.desc), shm_dir=resp.shm_dir,
                             tensors=tuple(TensorLocation(t.segment, t.offset) for t in resp.tensors))
        self.remote_caches[cache_id] = remote
        return remote

    def forget_cache(self, cache_id: int) -> None:
        remote = self.remote_caches.pop(cache_id, None)
        if remote is not None and self.channel is not None:
            self.channel.forget(remote)

    def mark_broken(self, reason: str, *, final: bool = False) -> None:
        """`final`: the peer restarted or dropped the link, so only unlink + link (or auto re-link) repairs it;
        otherwise (a failed transfer, missed heartbeats) the next good heartbeat makes the link READY again."""
        if self.state != LinkState.BROKEN:
            log.warning("link to cluster %d is BROKEN: %s", self.remote_cluster_id, reason)
        self.state = LinkState.BROKEN
        self.reason = reason
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
        if self.grpc_channel is not None:
            await self.grpc_channel.close()


@dataclass(frozen=True, slots=True)
class InboundLink:
    remote_cluster_id: int
    remote_epoch: str
    created: float
    secret: bytes


class LinkTable:
    def __init__(self, cluster_id: int, epoch: str, backends: tuple[str, ...],
                 executor: concurrent.futures.Executor, *, credentials: grpc.ChannelCredentials | None = None,
                 data_tls: ssl.SSLContext | None = None, max_links: int = MAX_LINKS,
                 auto_relink: bool = False, shm_dir: Path = Path("/dev/shm")) -> None:
        self.cluster_id = cluster_id
        self.shm_dir = shm_dir
        self._credentials = credentials
        self._data_tls = data_tls
        self.max_links = max_links
        self.auto_relink = auto_relink
        self.epoch = epoch
        self.backends = backends
        self._executor = executor  # for the parts of a transfer (see daemon.py)
        self.links: dict[int, Link] = {}
        self.inbound: dict[bytes, InboundLink] = {}
        """Links peers made to us, by link id."""

    # -- outbound ------------------------------------------------------------------------------------------------
    def get_ready(self, cluster_id: int) -> Link:
        link = self.links.get(cluster_id)
        if link is None or link.state == LinkState.LINKING:
            fail(LlmStatus.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked; call LinkClusters first",
                 cluster_id=cluster_id)
        if link.state == LinkState.BROKEN:
            fail(LlmStatus.LLM_LINK_FAILED, f"link to cluster {cluster_id} is BROKEN ({link.reason}); unlink and "
                 "link again", cluster_id=cluster_id)
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
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"link limit reached ({self.max_links})")
        link = self.links[cluster_id] = Link(cluster_id, address)
        try:
            await self._handshake(link, timeout)
        except BaseException:
            del self.links[cluster_id]
            await link.close()
            raise
        link.heartbeat = asyncio.create_task(self._heartbeat_loop(link))
        log.info("linked to cluster %d at %s (backend %s)", cluster_id, address, link.backend)
        return link

    async def _handshake(self, link: Link, timeout: float) -> None:
        link.grpc_channel = (grpc.aio.insecure_channel(link.remote_address) if self._credentials is None else
                             grpc.aio.secure_channel(link.remote_address, self._credentials))
        link.stub = peer_pb2_grpc.PeerStub(link.grpc_channel)
        req = peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, cluster_id=self.cluster_id,
                                        instance_epoch=self.epoch, expected_cluster_id=link.remote_cluster_id)
        try:
            resp = await link.stub.Handshake(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                fail(LlmStatus.LLM_LINK_FAILED, f"cluster {link.remote_cluster_id} at {link.remote_address} did not "
                     f"answer within {timeout:.3g} s")
            fail(LlmStatus.LLM_LINK_FAILED, f"cluster {link.remote_cluster_id} at {link.remote_address} refused: "
                 f"{e.details() or e.code().name}")
        if resp.protocol_version != PROTOCOL_VERSION:
            fail(LlmStatus.LLM_LINK_FAILED, f"peer speaks protocol {resp.protocol_version}, we speak "
                 f"{PROTOCOL_VERSION}")
        if resp.cluster_id != link.remote_cluster_id:
            fail(LlmStatus.LLM_LINK_FAILED, f"{link.remote_address} is cluster {resp.cluster_id}, not "
                 f"{link.remote_cluster_id}")
        link.remote_epoch = resp.instance_epoch
        link.token = resp.link_token
        link.channel, link.backend = self._choose_backend(link, resp)
        link.state = LinkState.READY
        link.last_seen = time.time()

    def _choose_backend(self, link: Link, resp: peer_pb2.HandshakeResponse) -> tuple[PeerChannel, str]:
        peer_backends = set(resp.backends)
        for name in self.backends:
            if name not in peer_backends:
                continue
            if name == shm_backend.NAME:
                control = shm_backend.probe(PurePath(resp.shm_probe_path).name, resp.shm_probe_nonce, self.shm_dir)
                if control is None:
                    log.info("cluster %d: shm probe failed (no shared host memory); trying the next backend",
                             link.remote_cluster_id)
                    continue
                return shm_backend.ShmChannel(control, self._executor, self.shm_dir), name
            if name == tcp_backend.NAME:
                host, _, port = resp.data_address.rpartition(":")
                if not host:
                    host = link.remote_address.rpartition(":")[0]
                return tcp_backend.TcpChannel(host.strip("[]"), int(port), link.token, self._executor,
                                              tls=self._data_tls), name
        fail(LlmStatus.LLM_LINK_FAILED, f"no common backend: we allow {list(self.backends)}, cluster "
             f"{link.remote_cluster_id} serves {sorted(peer_backends)}")

    async def unlink(self, cluster_id: int, force: bool, timeout: float) -> None:
        link = self.links.get(cluster_id)
        if link is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked")
        if link.state == LinkState.LINKING:
            fail(LlmStatus.LLM_PROCESSING_LINK, f"a link to cluster {cluster_id} is being made")
        notified = True
        try:
            assert link.stub is not None
            await link.stub.Unlink(peer_pb2.PeerUnlinkRequest(link_token=link.token, cluster_id=self.cluster_id),
                                   timeout=timeout)
        except grpc.aio.AioRpcError as e:
            notified = e.code() == grpc.StatusCode.FAILED_PRECONDITION  # The peer had already forgotten us.
            if not notified and not force:
                fail(LlmStatus.LLM_UNLINK_FAILED, f"cannot tell cluster {cluster_id}: {e.code().name}; use force "
                     "to remove our side anyway")
        del self.links[cluster_id]
        await link.close()
        log.info("unlinked cluster %d%s", cluster_id, "" if notified else " (forced; peer not told)")

    async def _heartbeat_loop(self, link: Link) -> None:
        misses = 0
        assert link.stub is not None
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                resp = await link.stub.Heartbeat(peer_pb2.HeartbeatRequest(link_token=link.token),
                                                 timeout=HEARTBEAT_INTERVAL_S)
            except grpc.aio.AioRpcError as e:
                misses += 1
                if misses >= HEARTBEAT_MISSES:
                    link.mark_broken(f"no heartbeat answer {misses} times ({e.code().name})")
                continue
            misses = 0
            link.last_seen = time.time()
            if resp.instance_epoch != link.remote_epoch:
                if self.auto_relink and await self._relink(link):
                    continue
                link.mark_broken("the peer restarted (new instance epoch); unlink and link again", final=True)
            elif not resp.link_known:
                link.mark_broken("the peer removed this link", final=True)
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
        link.state, link.final = LinkState.LINKING, False
        try:
            if link.grpc_channel is not None:
                await link.grpc_channel.close()
            await self._handshake(link, timeout=3.0)
        except LlmError as e:
            link.mark_broken(f"the peer restarted and re-linking failed: {e.message}", final=True)
            return False
        log.info("cluster %d restarted: re-linked (epoch %s, backend %s)", link.remote_cluster_id,
                 link.remote_epoch, link.backend)
        return True

    async def close(self) -> None:
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
        self.inbound.clear()

    # -- inbound -------------------------------------------------------------------------------------------------
    def accept(self, req: peer_pb2.HandshakeRequest) -> bytes:
        """Checks a peer's handshake; returns the link token it will present."""
        if req.protocol_version != PROTOCOL_VERSION:
            fail(LlmStatus.LLM_LINK_FAILED, f"protocol {req.protocol_version} is not supported (we speak "
                 f"{PROTOCOL_VERSION})")
        if req.expected_cluster_id != self.cluster_id:
            fail(LlmStatus.LLM_LINK_FAILED, f"this is cluster {self.cluster_id}, not {req.expected_cluster_id}")
        if req.cluster_id == self.cluster_id:
            fail(LlmStatus.LLM_LINK_FAILED, f"the caller uses our own cluster id {self.cluster_id}")
        if len(self.inbound) >= self.max_links:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"inbound link limit reached ({self.max_links})")
        # A peer that re-links (e.g. after a restart) replaces its older inbound links.
        for lid, old in list(self.inbound.items()):
            if old.remote_cluster_id == req.cluster_id:
                del self.inbound[lid]
        secret = linkauth.new_secret()
        self.inbound[linkauth.link_id(secret)] = InboundLink(req.cluster_id, req.instance_epoch, time.time(), secret)
        return secret

    def authorize(self, token: bytes) -> InboundLink:
        """Checks the link secret a peer presents on the (TLS-protected) peer API."""
        link = self.inbound.get(linkauth.link_id(bytes(token)))
        if link is None or not hmac.compare_digest(link.secret, bytes(token)):
            fail(LlmStatus.LLM_NOT_YET_LINK, "unknown link token: link first")
        return link

    def secret_for(self, lid: bytes) -> bytes | None:
        """For the data plane's challenge (any thread; dict lookups are atomic)."""
        link = self.inbound.get(bytes(lid))
        return None if link is None else link.secret

    def drop_inbound(self, token: bytes) -> None:
        self.inbound.pop(linkauth.link_id(bytes(token)), None)


__all__ = ["PROTOCOL_VERSION", "InboundLink", "Link", "LinkTable", "LlmError"]
