"""Mutual TLS material from the files the config names: gRPC credentials for the peer API, ssl contexts for data
connections; and the cluster ids a peer's certificate names."""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    ca: bytes
    paths: tuple[str, str, str]

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> TlsMaterial | None:
        """The material in PEM files `cert`, `key` and `ca` (None when no certificate is configured)."""
        if not cert:
            return None
        paths = (cert, key, ca)
        cert_pem, key_pem, ca_pem = (Path(p).read_bytes() for p in paths)
        return cls(cert_pem, key_pem, ca_pem, paths)

    def server_credentials(self) -> grpc.ServerCredentials:
        """The peer API: a peer must present a certificate that chains to our CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def data_server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.paths[0], self.paths[1])
        ctx.load_verify_locations(self.paths[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def data_client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(self.paths[0], self.paths[1])
        ctx.load_verify_locations(self.paths[2])
        return ctx


CLUSTER_URI_PREFIX = "kvbroker://cluster/"
"""A certificate names the cluster ids its holder may claim as URI SANs `kvbroker://cluster/<decimal id>`."""


def cluster_uri(cluster_id: int) -> str:
    return f"{CLUSTER_URI_PREFIX}{cluster_id}"


def certified_cluster_ids(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[int] | None:
    """The cluster ids a TLS caller's certificate names (gRPC's auth context of the call), or None where it names
    none (no certificate: a token deployment; or one issued without names, which keeps working). A name that is no
    uint64 counts as naming, and names nothing: such a certificate can claim no id."""
    uris = [uri.decode(errors="replace") for uri in auth_context.get("peer_uri", ())]
    named = [uri[len(CLUSTER_URI_PREFIX):] for uri in uris if uri.startswith(CLUSTER_URI_PREFIX)]
    if not named:
        return None
    return frozenset(int(n) for n in named if n.isascii() and n.isdigit() and len(n) <= 20 and int(n) < 2**64)
