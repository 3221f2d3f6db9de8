"""Peer addresses: HOST:PORT and nothing else.

Peers are network daemons, so a LinkClusters address names a host (an IPv4 address, a bracketed IPv6 address or a DNS
name) and a port (1..65535). gRPC would dial anything its resolvers know (`unix:/path`, `unix-abstract:name`,
`vsock:`, `ipv4:a,b`): given one, the daemon connected to another local service's socket and sent it an HTTP/2
preface (issue 30, finding 9). A refused address is refused before any connection; the address is then dialled through
gRPC's `dns` resolver by name (`dial_target`), so no host can be read as a scheme.
"""

from __future__ import annotations

import ipaddress
import re

from kvbrokerd.errors import param_invalid
from kvbrokerd.limits import MAX_ADDRESS_BYTES, check_text

GRPC_SCHEMES = frozenset({"dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p", "passthrough"})
"""Resolver schemes of gRPC: `unix:7100` would be read as a socket path, not as host `unix`."""
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_MAX_DNS_NAME = 253


def peer_address_problem(address: str) -> str | None:
    """Why `address` is not HOST:PORT, or None where it is."""
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "is not HOST:PORT (a host, then a colon and a port)"
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
        return f"has port {port[:8]!r}: a port is a number from 1 to 65535"
    if host.startswith("["):
        inner = host[1:-1] if host.endswith("]") else ""
        if "%" in inner or not _is_ipv6(inner):
            return "has no IPv6 address between its brackets (zone ids are not accepted)"
        return None
    if ":" in host:
        return "has colons in its host: a scheme (unix:, dns:, ...) is not a peer address; put an IPv6 address in " \
               "brackets ([::1]:7100)"
    if host.lower().rstrip(".") in GRPC_SCHEMES:
        return f"names host {host!r}, which gRPC reads as a scheme (peers are HOST:PORT)"
    return None if _is_ipv4(host) or _is_dns_name(host) else f"has host {host[:64]!r}, neither an IP address nor a " \
                                                             "DNS name"


def check_peer_address(address: str) -> str:
    """`address` if it is HOST:PORT; otherwise LLM_PARAM_INVALID, saying why."""
    check_text("remote_address", address, MAX_ADDRESS_BYTES)
    problem = peer_address_problem(address)
    if problem:
        param_invalid(f"remote_address {address[:80]!r} {problem}")
    return address


def dial_target(address: str) -> str:
    """The gRPC target of a checked peer address: its own resolver named, so nothing in it is read as a scheme."""
    return "dns:///" + address


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def _is_dns_name(text: str) -> bool:
    """A DNS name (RFC 1123 labels) whose last label is not all digits (`127.1`, `7` would read as IPv4)."""
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    return (0 < len(name) <= _MAX_DNS_NAME and all(_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit())
