"""Shared parts of the security tests: a test PKI, and a client that records its close.

The PKI is generated with `cryptography` (EC P-256, which is fast) into a
directory, so tests hand Pylon real files exactly as an operator would.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.quic.events import ConnectionTerminated, QuicEvent
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tunnel.client import ClientResponse, H3Client
from tunnel.types import StreamAborted

STARGATE_URI = "spiffe://platform.example/stargate"
STARGATE_DNS = "stargate.platform.example"


@dataclass(frozen=True)
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    """The trusted CA bundle (what `auth.client_ca_file` points at)."""
    client: tuple[Path, Path]
    """A Stargate client certificate and key from the trusted CA."""
    foreign_client: tuple[Path, Path]
    """Same names, issued by another CA."""
    wrong_san_client: tuple[Path, Path]
    """From the trusted CA, with a SAN that is not on the allow-list."""
    server_usage_client: tuple[Path, Path]
    """From the trusted CA, with the Stargate SANs, but only for server authentication."""
    expired_client: tuple[Path, Path]
    """From the trusted CA, with the Stargate SANs, expired yesterday."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def authority(name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Authority(name, key, certificate)


def issue(
    ca: Authority,
    *,
    sans: list[x509.GeneralName],
    usage: x509.ObjectIdentifier = ExtendedKeyUsageOID.CLIENT_AUTH,
    expired: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(days=3 if expired else 0, hours=1)
    end = now - datetime.timedelta(days=1) if expired else now + datetime.timedelta(days=1)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name("client"))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return certificate, key


def write_pair(
    directory: Path, name: str, pair: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]
) -> tuple[Path, Path]:
    certificate, key = pair
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


STARGATE_SANS: list[x509.GeneralName] = [
    x509.DNSName(STARGATE_DNS),
    x509.UniformResourceIdentifier(STARGATE_URI),
]


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    trusted, foreign = authority("platform-ca"), authority("other-ca")
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(trusted.certificate.public_bytes(serialization.Encoding.PEM))
    intruder = [x509.DNSName("intruder.example")]
    return Pki(
        ca_file=ca_file,
        client=write_pair(directory, "client", issue(trusted, sans=STARGATE_SANS)),
        foreign_client=write_pair(directory, "foreign", issue(foreign, sans=STARGATE_SANS)),
        wrong_san_client=write_pair(directory, "wrong-san", issue(trusted, sans=intruder)),
        server_usage_client=write_pair(
            directory,
            "server-usage",
            issue(trusted, sans=STARGATE_SANS, usage=ExtendedKeyUsageOID.SERVER_AUTH),
        ),
        expired_client=write_pair(
            directory, "expired", issue(trusted, sans=STARGATE_SANS, expired=True)
        ),
    )


class RecordingClient(H3Client):
    """An H3Client that remembers how its connection ended."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.terminated: ConnectionTerminated | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self.terminated = event
        super().quic_event_received(event)

    async def response(self, stream_id: int) -> ClientResponse:
        if self.terminated is not None:  # the stream was opened on a dead connection
            raise StreamAborted(self.terminated.error_code)
        return await super().response(stream_id)
