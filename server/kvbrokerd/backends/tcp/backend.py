"""`tcp` backend: the cross-host path over the daemons' own data sockets (not gRPC): the data server serves our
caches (server.py), a channel per link pulls and pushes (channel.py), over the wire format of wire.py."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from kvbrokerd.backends.base import (
    Backend,
    BackendUnusable,
    Capabilities,
    LocalContext,
    PeerChannel,
    PeerInfo,
)
from kvbrokerd.backends.tcp.channel import (
    TcpChannel,
)
from kvbrokerd.backends.tcp.server import (
    DataServer,
)
from kvbrokerd.backends.tcp.wire import (
    NAME,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)

CAPABILITIES = Capabilities(same_host_only=False, one_sided_read=False)


class TcpBackend(Backend):
    """Serves this daemon's caches on its data port and advertises the port; peers dial the host they reached our
    peer API on (an advertisement never names a host)."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, ctx: LocalContext) -> None:
        super().__init__(ctx)
        self.server: DataServer | None = None

    async def start(self) -> None:
        self.server = DataServer(self.ctx.registry, self.ctx.secret_for, self.ctx.peer_host, self.ctx.data_port,
                                 tls=self.ctx.data_server_tls)
        self.server.start()

    @property
    def serving(self) -> bool:
        return self.server is not None and self.server.serving

    @property
    def port(self) -> int:
        return 0 if self.server is None else self.server.port

    def advertise(self) -> bytes:
        return json.dumps({"port": self.port}).encode()

    def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            port = json.loads(info)["port"]
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable tcp advertisement ({type(e).__name__})") from None
        if type(port) is not int or not 0 < port < 65536:
            raise BackendUnusable(f"invalid tcp data port {str(port)[:20]!r}")
        host = peer.peer_address.rpartition(":")[0].strip("[]")
        return TcpChannel(host, port, peer.secret, self.ctx.parts_executor, tls=self.ctx.data_client_tls)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


BACKEND = TcpBackend
