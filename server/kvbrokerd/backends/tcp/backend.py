"""`tcp` backend: the cross-host path over the daemons' own data sockets (not gRPC): the data server serves our
caches (server.py), a channel per link pulls and pushes (channel.py), over the wire format of wire.py."""

from __future__ import annotations

import json
import logging
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbrokerd.backends.common.sockio import MinRate
from kvbrokerd.backends.tcp.channel import TcpChannel
from kvbrokerd.backends.tcp.server import DataServer
from kvbrokerd.backends.tcp.wire import MAX_REQUEST_S, MIN_RATE_BYTES_PER_S, NAME, RATE_WINDOW_S
from kvbrokerd.dataplane.seam import (
    Backend,
    BackendSettings,
    BackendUnusable,
    Capabilities,
    DaemonFacts,
    LocalContext,
    PeerChannel,
    PeerInfo,
)

if TYPE_CHECKING:
    from kvbrokerd.tls import TlsMaterial

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TcpSettings(BackendSettings):
    port: int = field(default=0, metadata={
        "help": "data-plane port on the peer host (0 = any free port)", "aliases": ("data_port",)})
    tls: bool = field(default=False, metadata={
        "help": "TLS on data connections too (needs the daemon's tls_*)", "aliases": ("data_tls",)})
    min_rate: int = field(default=MIN_RATE_BYTES_PER_S, metadata={
        "help": "bytes/s below which a peer reading or writing one of our caches is abandoned (it pins the cache "
                "against release and lease expiry); 0 = no minimum"})
    rate_window_s: float = field(default=RATE_WINDOW_S, metadata={
        "help": "seconds over which min_rate is averaged (each window of a request must reach it)"})

    def check(self, daemon: DaemonFacts) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port")
        if not 0 <= self.min_rate <= 1 << 40:
            raise ValueError(f"min_rate: {self.min_rate} bytes/s is not in [0, 2^40]")
        if not 0.1 <= self.rate_window_s <= MAX_REQUEST_S:
            raise ValueError(f"rate_window_s: {self.rate_window_s} s is not in [0.1, {MAX_REQUEST_S:g}]")
        if self.tls and not daemon.mutual_tls:
            raise ValueError("tls: needs tls_cert, tls_key and tls_ca")


class TcpBackend(Backend):
    """Serves this daemon's caches on its data port and advertises the port; peers dial the host they reached our
    peer API on (an advertisement never names a host)."""

    name = NAME
    capabilities = Capabilities()
    settings_type = TcpSettings
    default = True

    def __init__(self, ctx: LocalContext) -> None:
        super().__init__(ctx)
        self.server: DataServer | None = None
        self._client_tls: ssl.SSLContext | None = None

    @property
    def settings(self) -> TcpSettings:
        assert isinstance(self.ctx.settings, TcpSettings)
        return self.ctx.settings

    @classmethod
    def listen_addresses(cls, settings: BackendSettings, peer_host: str) -> list[tuple[str, str]]:
        assert isinstance(settings, TcpSettings)
        if not settings.port:
            return []
        return [(f"[{peer_host}]:{settings.port}" if ":" in peer_host else f"{peer_host}:{settings.port}",
                 "tcp data plane")]

    @property
    def endpoint(self) -> str:
        return f":{self.port}"

    def _tls(self) -> TlsMaterial | None:
        return self.ctx.tls if self.settings.tls else None

    async def start(self) -> None:
        tls = self._tls()
        self.server = DataServer(self.ctx.registry, self.ctx.secret_for, self.ctx.peer_host, self.settings.port,
                                 tls=tls.data_server_context() if tls else None,
                                 min_rate=MinRate(self.settings.min_rate, self.settings.rate_window_s))
        self.server.start()
        self._client_tls = tls.data_client_context() if tls else None

    @property
    def serving(self) -> bool:
        return self.server is not None and self.server.serving

    @property
    def port(self) -> int:
        return 0 if self.server is None else self.server.port

    def advertise(self) -> bytes:
        return json.dumps({"port": self.port}).encode()

    async def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            port = json.loads(info)["port"]
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable tcp advertisement ({type(e).__name__})") from None
        if type(port) is not int or not 0 < port < 65536:
            raise BackendUnusable(f"invalid tcp data port {str(port)[:20]!r}")
        host = peer.peer_address.rpartition(":")[0].strip("[]")
        return TcpChannel(host, port, peer.secret, self.ctx.parts_executor, tls=self._client_tls)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


BACKEND = TcpBackend
