"""Development certificate: self-signed, generated once into the state directory, reused."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DEV_CERT_NAME = "dev-cert.pem"
DEV_KEY_NAME = "dev-key.pem"
DEV_CERT_VALIDITY = datetime.timedelta(days=365)


def ensure_dev_certificate(state_dir: Path) -> tuple[Path, Path]:
    """Paths of a localhost certificate and key, creating them on first use."""
    cert_path, key_path = state_dir / DEV_CERT_NAME, state_dir / DEV_KEY_NAME
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path
    state_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed(key)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _self_signed(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pylon-dev")])
    now = datetime.datetime.now(datetime.UTC)
    alt_names = x509.SubjectAlternativeName(
        [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + DEV_CERT_VALIDITY)
        .add_extension(alt_names, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
