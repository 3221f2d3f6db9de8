"""Daemon lifecycle: start the registry, data plane and both gRPC listeners; drain and stop on SIGTERM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import resource
import signal
import socket
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbroker.types import LinkState
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvbrokerd import backends, tracing
from kvbrokerd.backends.common import memcopy
from kvbrokerd.config import Config
from kvbrokerd.dataplane.seam import Backend, LocalContext
from kvbrokerd.links import linkauth
from kvbrokerd.links.inbound import InboundShares
from kvbrokerd.links.table import LinkTable
from kvbrokerd.listen import ListenError, check_tcp_free, claim_unix_socket, in_use, unix_path
from kvbrokerd.metrics import Metrics
from kvbrokerd.node import Node
from kvbrokerd.reflection import commented_pool
from kvbrokerd.registry.caches import CacheEntry, Registry
from kvbrokerd.registry.grants import GrantTable
from kvbrokerd.registry.sessions import SessionTable
from kvbrokerd.service.local import KvBrokerService
from kvbrokerd.service.peer import PeerService
from kvbrokerd.tls import TlsMaterial
from kvbrokerd.transfers.manager import TransferManager

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
BACKEND_WATCH_INTERVAL_S = 1.0
_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Peers send small requests only; a stranger must not make us buffer 64 MiB messages.
MAX_PEER_REQUEST_BYTES = 1 << 20
MAX_PEER_CONNECTIONS = 1024
"""Connections the peer port holds at once (gRPC closes newer ones as soon as they are accepted); never more than a
quarter of the process's descriptor limit, so that strangers holding connections cannot take the descriptors that
caches, data connections and the local API need."""
PEER_IDLE_TIMEOUT_S = 60.0
"""A peer-port connection with no call for this long is closed (linked peers heartbeat every second)."""
PEER_MAX_AGE_S = 600.0
PEER_AGE_GRACE_S = 30.0
"""Every peer-port connection is retired (GOAWAY) after PEER_MAX_AGE_S, its calls given PEER_AGE_GRACE_S to finish:
the bound on a stranger that keeps a connection busy with a call it never completes. Peers' channels reconnect."""
PEER_HANDSHAKE_TIMEOUT_S = 10.0
"""A connection must finish its TLS and HTTP/2 handshakes within this."""
PEER_MAX_STREAMS = 128
"""Concurrent calls on one peer-port connection."""


def peer_server_options() -> list[tuple[str, Any]]:
    """The peer port's gRPC options: small messages, a connection cap and idle, age and handshake timeouts."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = MAX_PEER_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_PEER_CONNECTIONS, soft // 4))
    return [*_SERVER_OPTIONS[:1], ("grpc.max_receive_message_length", MAX_PEER_REQUEST_BYTES), *_SERVER_OPTIONS[2:],
            ("grpc.max_allowed_incoming_connections", cap),
            ("grpc.max_connection_idle_ms", int(PEER_IDLE_TIMEOUT_S * 1000)),
            ("grpc.max_connection_age_ms", int(PEER_MAX_AGE_S * 1000)),
            ("grpc.max_connection_age_grace_ms", int(PEER_AGE_GRACE_S * 1000)),
            ("grpc.server_handshake_timeout_ms", int(PEER_HANDSHAKE_TIMEOUT_S * 1000)),
            ("grpc.max_concurrent_streams", PEER_MAX_STREAMS),
            # Dead connections are found by our pings; a peer may not ping us more than every 10 s without calls.
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000), ("grpc.http2.max_ping_strikes", 2)]
LOCAL_SERVICE = broker_pb2.DESCRIPTOR.services_by_name["KvBroker"].full_name
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name


class Daemon:
    """`await start()`, then `await wait()` (or `stop()`); `stop()` is idempotent. Constructor does no I/O."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node: Node | None = None
        self.local_address = ""
        self.peer_address = ""
        self._servers: list[grpc.aio.Server] = []
        self._health: list[tuple[health.aio.HealthServicer, str]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._parts_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._backends: list[Backend] = []
        self._health_watch: asyncio.Task[None] | None = None
        self._registry: Registry | None = None
        self._links: LinkTable | None = None
        self._sessions: SessionTable | None = None
        self._grants: GrantTable | None = None
        self.metrics: Metrics | None = None
        self.metrics_port = 0
        self._stopped = asyncio.Event()
        self._stopping = False
        self._owns_socket = False

    async def start(self) -> None:
        cfg = self.config
        _claim_addresses(cfg)  # before anything is created: a refusal leaves no trace and touches nobody's socket
        try:
            if cfg.otlp_traces_endpoint:  # first: the services install their traced handlers when they are made
                tracing.start(cfg.otlp_traces_endpoint, cluster_id=cfg.cluster_id)
                log.info("tracing on: spans to %s over OTLP/gRPC", cfg.otlp_traces_endpoint)
            self._registry = Registry(Path(cfg.shm_dir), cfg.max_caches)
            self._registry.open()
            epoch = self._registry.instance
            # Two pools: transfers run on one and may wait on the parts they spread over the other. Parts never wait on
            # anything, so many concurrent transfers cannot starve their own parts (a deadlock with one pool).
            self._executor = concurrent.futures.ThreadPoolExecutor(cfg.data_threads, "kvbroker-transfer")
            self._parts_executor = concurrent.futures.ThreadPoolExecutor(cfg.data_threads, "kvbroker-part")
            tls = TlsMaterial.load(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
            if cfg.insecure_peers and not (cfg.peer_token_file or tls):
                log.warning("--insecure-peers: ANY process that reaches the peer port can link to this daemon and "
                            "read or write its caches; use --peer-token-file or mutual TLS outside development")
            self._links = LinkTable(
                cfg.cluster_id, epoch, {},
                token=linkauth.load_token(cfg.peer_token_file) if cfg.peer_token_file else None,
                credentials=tls.channel_credentials() if tls else None,
                max_links=cfg.max_links, auto_relink=cfg.auto_relink, inbound_ttl_s=cfg.peer_link_ttl,
                broken_link_ttl_s=cfg.broken_link_ttl, idle_link_ttl_s=cfg.idle_link_ttl,
                inbound_shares=InboundShares(cfg.peer_links_per_cluster, cfg.peer_links_per_network,
                                             cfg.peer_network_prefix_v4, cfg.peer_network_prefix_v6))
            links = self._links
            self.metrics = metrics = Metrics(linked=lambda peer: peer.isdigit() and int(peer) in links.links)
            links.on_removed.append(lambda cluster_id: metrics.forget_peer(str(cluster_id)))
            transfers = TransferManager(self._registry, self._links, self._executor, self._parts_executor,
                                        max_transfers=cfg.max_transfers, max_inflight_bytes=cfg.max_inflight_bytes,
                                        parallel_transfers=cfg.parallel_transfers,
                                        metrics=self.metrics)
            self._sessions = SessionTable(self._registry)
            self._sessions.start()
            peer_host = cfg.peer_listen.rpartition(":")[0].strip("[]")
            for name in cfg.backends:
                ctx = LocalContext(
                    cluster_id=cfg.cluster_id, registry=self._registry, shm_dir=Path(cfg.shm_dir),
                    peer_host=peer_host, parts_executor=self._parts_executor, secret_for=self._links.secret_for,
                    settings=cfg.settings_of(name), tls=tls)
                backend = backends.backend_class(name)(ctx)
                self._backends.append(backend)
                try:
                    await backend.start()
                except OSError as e:
                    raise ListenError(f"cannot start the {name} data plane: {e.strerror or e}") from None
                self._registry.on_remove.append(backend.forget_cache)  # engines drop their registrations
            self._links.backends = {b.name: b for b in self._backends}
            node = Node(cfg.cluster_id, epoch, "", cfg.backends, self._registry, self._links, transfers,
                        self._sessions, max_session_message_pairs=cfg.max_session_message_pairs)
            node.grants.max_blocks = cfg.max_granted_blocks
            node.grants.start()
            loop = asyncio.get_running_loop()
            # Removal hooks run on an executor thread; the grant table lives on the event loop.
            def end_grants(entry: CacheEntry) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is gone, and its grants
                    loop.call_soon_threadsafe(node.grants.cache_removed, entry.cache_id)

            self._registry.on_remove.append(end_grants)
            self._grants = node.grants
            peer_port = await self._serve(cfg.peer_listen, node, PEER_SERVICE,
                                          tls.server_credentials() if tls else None)
            self.peer_address = cfg.advertise_address or _advertised(peer_host, peer_port)
            node.peer_address = self.peer_address
            self.local_address = await self._serve_local(cfg.listen, node)
            self.node = node
            self.metrics.watch(self._state)
            if cfg.metrics_listen:
                self.metrics_port = self.metrics.serve(cfg.metrics_listen)
                node.metrics_address = f"{cfg.metrics_listen.rpartition(':')[0]}:{self.metrics_port}"
            await self._set_health(serving=True)
            self._health_watch = asyncio.create_task(self._watch_backends())
        except BaseException:
            await self.stop(grace=0)
            raise
        log.log(*memcopy.copy_path())
        log.info("kvbrokerd ready: cluster %d, local API %s, peer API %s, backends %s", cfg.cluster_id,
                 self.local_address, self.peer_address,
                 ",".join(f"{b.name}{'=' + b.endpoint if b.endpoint else ''}" for b in self._backends))

    async def _set_health(self, *, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for h, name in self._health:
            await h.set("", status)
            await h.set(name, status)

    async def _watch_backends(self) -> None:
        """Health follows the data plane: NOT_SERVING while a backend's server is down (e.g. its accept loop is
        backing off from EMFILE), SERVING again when it recovers."""
        serving = True
        while True:
            await asyncio.sleep(BACKEND_WATCH_INTERVAL_S)
            down = [b.name for b in self._backends if not b.serving]
            if bool(down) == serving:
                serving = not down
                if down:
                    log.error("data plane down (%s): health is NOT_SERVING", ", ".join(down))
                else:
                    log.info("data plane serving again: health is SERVING")
                await self._set_health(serving=serving)

    async def _serve(self, address: str, node: Node, service: str,
                     credentials: grpc.ServerCredentials | None = None) -> int:
        """One listener: the local API (KvBroker) or the peer API (Peer), each with health and reflection. The
        local API is never served on the peer port: that port is reachable from the network."""
        server = grpc.aio.server(options=_SERVER_OPTIONS if service == LOCAL_SERVICE else peer_server_options())
        if service == LOCAL_SERVICE:
            broker_pb2_grpc.add_KvBrokerServicer_to_server(KvBrokerService(node), server)
        else:
            peer_pb2_grpc.add_PeerServicer_to_server(PeerService(node), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server,
            pool=commented_pool())
        what = "local API" if service == LOCAL_SERVICE else "peer API"
        try:
            port: int = (server.add_insecure_port(address) if credentials is None else
                         server.add_secure_port(address, credentials))
        except RuntimeError:  # gRPC says only "failed to bind"; on a port, most likely a listener that came first
            if address.startswith("unix:"):
                raise ListenError(f"cannot listen on {address} ({what}): cannot bind the socket there (check the "
                                  "directory's permissions)") from None
            raise in_use(address, what) from None
        if port == 0 and not address.startswith("unix:"):
            raise in_use(address, what)
        await server.start()
        self._servers.append(server)
        self._health.append((health_servicer, service))
        return port

    async def _serve_local(self, listen: str, node: Node) -> str:
        if not listen.startswith("unix://"):
            port = await self._serve(listen, node, LOCAL_SERVICE)
            return f"{listen.rpartition(':')[0]}:{port}"
        old_umask = os.umask(0o177)  # The socket is born 0600: only this user may drive the daemon.
        try:
            await self._serve(listen, node, LOCAL_SERVICE)
        finally:
            os.umask(old_umask)
        self._owns_socket = True
        return listen

    def _state(self) -> dict[str, Any]:
        """The daemon's state for the metrics scrape (read from another thread: snapshots only)."""
        node = self.node
        assert node is not None
        states = {s.name: 0 for s in LinkState}
        for link in list(node.links.links.values()):
            states[link.state.name] += 1
        caches = node.registry.list()
        reclaimed = {("outbound", reason): n for reason, n in node.links.reclaimed.items()}
        reclaimed.update({("inbound", reason): n for reason, n in node.links.inbound.reclaimed.items()})
        return {"links": states, "inbound_links": len(node.links.inbound.links), "links_reclaimed": reclaimed,
                "caches": len(caches),
                "registered_bytes": sum(e.desc.tensor_nbytes * e.desc.num_tensors for e in caches),
                "transfers_in_flight": node.transfers.runner.in_flight,
                "inflight_bytes": node.transfers.runner.inflight_bytes,
                "sessions": len(node.sessions), "grants": len(node.grants), "grants_ended": dict(node.grants.ended),
                "grants_redeemed": node.grants.redeemed, "grant_answers": dict(node.links.grant_answers),
                "grant_renewals_in_flight": sum(len(link.renewing) for link in list(node.links.links.values())),
                "grant_pulls_waiting": sum(link.waiting_on_renewals for link in list(node.links.links.values()))}

    async def stop(self, grace: float = 5.0) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self._health_watch is not None:
            self._health_watch.cancel()
        for h, _ in self._health:
            await h.enter_graceful_shutdown()
        await asyncio.gather(*(s.stop(grace) for s in self._servers))
        if self._sessions is not None:
            await self._sessions.stop()
        if self._grants is not None:
            await self._grants.stop()
        if self._links is not None:
            await self._links.close()
        for backend in self._backends:
            backend.close()
        for pool in (self._executor, self._parts_executor):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        if self._registry is not None:
            self._registry.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.config.otlp_traces_endpoint:
            tracing.shutdown()  # exports the spans still buffered
        if self._owns_socket:
            _remove_socket(self.config.listen)
        self._stopped.set()
        if self.node is not None:  # a daemon that never started has nothing to report (its error says why)
            log.info("kvbrokerd stopped")

    async def wait(self) -> None:
        await self._stopped.wait()

    async def run_until_signal(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received: draining")
        await self.stop()


def _claim_addresses(cfg: Config) -> None:
    """Refuses, with one line naming the address, any address another process holds; replaces a stale socket."""
    if cfg.listen.startswith("unix://"):
        claim_unix_socket(cfg.listen)
    else:
        check_tcp_free(cfg.listen, "local API")
    check_tcp_free(cfg.peer_listen, "peer API")
    peer_host = cfg.peer_listen.rpartition(":")[0].strip("[]")
    for name in cfg.backends:
        for address, what in backends.backend_class(name).listen_addresses(cfg.settings_of(name), peer_host):
            check_tcp_free(address, what)
    if cfg.metrics_listen:
        check_tcp_free(cfg.metrics_listen, "metrics")


def _remove_socket(listen: str) -> None:
    with contextlib.suppress(OSError):
        unix_path(listen).unlink()


def _advertised(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
