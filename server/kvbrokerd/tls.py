"""Mutual TLS material from the files the config names: gRPC credentials for the peer API, ssl contexts for data
connections."""

from __future__ import annotations

import ssl
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
