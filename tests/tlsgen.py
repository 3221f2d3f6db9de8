"""Test certificates made at run time: a CA, daemon certificates for loopback, and a stranger's CA."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvbrokerd.tls import cluster_uri


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


class Ca:
    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir = workdir
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.path = str(workdir / f"{name}-ca.crt")
        Path(self.path).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, cluster_ids: Sequence[int] = ()) -> tuple[str, str]:
        """(cert path, key path) of a certificate for loopback (127.0.0.1, localhost), usable as client and server,
        naming `cluster_ids` (URI SANs `kvbroker://cluster/<id>`: the ids its holder may claim)."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                         *(x509.UniformResourceIdentifier(cluster_uri(i)) for i in cluster_ids)]
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .sign(self.key, hashes.SHA256()))
        return _write(self.workdir / name, key, cert)

    def flags(self, name: str, data_tls: bool = False, cluster_ids: Sequence[int] = ()) -> list[str]:
        cert, key = self.issue(name, cluster_ids)
        return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", self.path, *(["--data-tls"] if data_tls else [])]
