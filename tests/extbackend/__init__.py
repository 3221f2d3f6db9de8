"""A data-plane backend that lives outside kvbrokerd: `relay`, registered only through the `kvbrokerd.backends`
entry point group (tests/integration/test_backend_plugin.py writes the entry point into a throw-away
distribution's metadata). It moves bytes with the tcp backend's data server and channel under its own name and
settings, so a pull over it is a real pull between two daemons through the plugin seam."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvbrokerd.backends.base import (
    Backend,
    BackendSettings,
    BackendUnusable,
    Capabilities,
    DaemonFacts,
    LocalContext,
    PeerChannel,
    PeerInfo,
)
from kvbrokerd.backends.tcp.channel import TcpChannel
from kvbrokerd.backends.tcp.server import DataServer


@dataclass(frozen=True)
class RelaySettings(BackendSettings):
    port: int = field(default=0, metadata={"help": "the relay's data port (0 = any free port)"})
    banner: str = field(default="relay", metadata={"help": "a word the relay logs at start (a setting to set)"})

    def check(self, daemon: DaemonFacts) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port")
        if not self.banner.isalnum():
            raise ValueError(f"banner: {self.banner!r} is not alphanumeric")


class RelayChannel(TcpChannel):
    name = "relay"


class RelayBackend(Backend):
    name = "relay"
    capabilities = Capabilities()
    settings_type = RelaySettings

    def __init__(self, ctx: LocalContext) -> None:
        super().__init__(ctx)
        self.server: DataServer | None = None

    @property
    def settings(self) -> RelaySettings:
        assert isinstance(self.ctx.settings, RelaySettings)
        return self.ctx.settings

    @property
    def endpoint(self) -> str:
        port = self.server.port if self.server is not None else 0
        return f"{self.settings.banner}:{port}"

    async def start(self) -> None:
        self.server = DataServer(self.ctx.registry, self.ctx.secret_for, self.ctx.peer_host, self.settings.port)
        self.server.start()

    def advertise(self) -> bytes:
        assert self.server is not None
        return json.dumps({"relay_port": self.server.port}).encode()

    async def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            port = json.loads(info)["relay_port"]
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable relay advertisement ({type(e).__name__})") from None
        if type(port) is not int or not 0 < port < 65536:
            raise BackendUnusable("invalid relay port")
        host = peer.peer_address.rpartition(":")[0].strip("[]")
        return RelayChannel(host, port, peer.secret, self.ctx.parts_executor)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
