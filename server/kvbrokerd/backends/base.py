"""The seam every engine implements, under the name that engines outside this repository import (the
`kvbrokerd.backends` entry point group): it lives in `kvbrokerd.dataplane.seam`, below both the transfer manager and
the engines."""

from kvbrokerd.dataplane.seam import (
    MAX_ADVERTISEMENT_BYTES,
    Backend,
    BackendSettings,
    BackendUnusable,
    Capabilities,
    DaemonFacts,
    DeviceKind,
    LocalContext,
    PeerChannel,
    PeerInfo,
    RemoteCache,
)

__all__ = ["MAX_ADVERTISEMENT_BYTES", "Backend", "BackendSettings", "BackendUnusable", "Capabilities", "DaemonFacts",
           "DeviceKind", "LocalContext", "PeerChannel", "PeerInfo", "RemoteCache"]
