"""Client-certificate authentication (mTLS) for the tunnel, which aioquic's server lacks.

Strategy: aioquic's TLS `Context` can send a CertificateRequest (behind a flag
it keeps for its own tests) and checks the client's CertificateVerify
signature, but it accepts an empty client Certificate and never verifies the
client's chain. `require_client_certificate` swaps each server connection's
context for `ClientVerifyingContext` the moment aioquic creates it (on the
first datagram). That subclass requests a certificate, refuses an empty one,
verifies the chain against the configured CA bundle with aioquic's own
`verify_certificate` (validity dates included) once the signature has proved
the key is held, checks the SAN allow-list, and will not accept the client's
Finished without a verified identity. Every refusal is a TLS alert, so the
peer gets CONNECTION_CLOSE with CRYPTO_ERROR + alert before the handshake
completes: no request stream is ever decrypted, let alone served.

This reaches into aioquic internals (`QuicConnection._initialize`,
`Context._server_handle_*`, `_request_client_certificate`); they stay in this
module and are pinned by tests against the aioquic version the project locks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from aioquic import tls
from aioquic._buffer import Buffer
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

__all__ = [
    "ClientAuth",
    "ClientVerifyingContext",
    "Refusal",
    "allowed_sans_from",
    "certificate_sans",
    "load_ca_bundle",
    "peer_identity",
    "require_client_certificate",
    "verify_client_certificate",
]


class Refusal(StrEnum):
    """Why a connection was refused during the handshake (a bounded metric label)."""

    NO_CLIENT_CERTIFICATE = "no_client_certificate"
    UNTRUSTED_CLIENT_CERTIFICATE = "untrusted_client_certificate"
    SAN_NOT_ALLOWED = "san_not_allowed"


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


class AlertAccessDenied(tls.Alert):
    """RFC 8446 §6.2: a valid certificate, but access control says no."""

    description = tls.AlertDescription.access_denied


_REFUSAL_BY_ALERT: dict[type[tls.Alert], Refusal] = {
    AlertCertificateRequired: Refusal.NO_CLIENT_CERTIFICATE,
    AlertAccessDenied: Refusal.SAN_NOT_ALLOWED,
}
"""Any other alert during client authentication means an untrusted certificate."""


@dataclass(frozen=True)
class ClientAuth:
    ca_pem: bytes
    """PEM bundle the client's chain must end in (canonical form, see `load_ca_bundle`)."""
    allowed_sans: frozenset[str] = frozenset()
    """DNS names or URIs the client certificate must carry one of; empty accepts any."""


def load_ca_bundle(path: Path) -> bytes:
    """The bundle re-serialized one certificate at a time; ValueError if it holds none.

    aioquic splits `cadata` on the exact PEM end line, so CRLF files or stray
    text between certificates would silently drop CAs: canonical PEM avoids it.
    """
    certificates = x509.load_pem_x509_certificates(path.read_bytes())
    return b"".join(certificate.public_bytes(Encoding.PEM) for certificate in certificates)


def certificate_sans(certificate: x509.Certificate) -> tuple[str, ...]:
    """DNS-name and URI subject alternative names, DNS names lowercased."""
    try:
        extension = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return ()
    names = extension.value
    dns = [name.lower() for name in names.get_values_for_type(x509.DNSName)]
    return (*dns, *names.get_values_for_type(x509.UniformResourceIdentifier))


def _check_client_usage(certificate: x509.Certificate) -> None:
    """A certificate restricted to other uses (a server certificate) is not a client's."""
    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
        raise tls.AlertBadCertificate("certificate is not valid for client authentication")


def verify_client_certificate(
    certificate: x509.Certificate, chain: list[x509.Certificate], auth: ClientAuth
) -> str:
    """The identity (matching SAN, or subject) of a trusted client; a TLS alert otherwise.

    Fails closed: anything the checks trip over (a malformed extension parsed
    lazily, an oddity the chain verifier rejects by raising) is a
    bad_certificate alert, never an exception escaping the handshake.
    """
    try:
        _check_client_usage(certificate)
        tls.verify_certificate(certificate=certificate, chain=chain, cadata=auth.ca_pem)
        sans = certificate_sans(certificate)
        identity = sans[0] if sans else certificate.subject.rfc4514_string()
    except tls.Alert:
        raise
    except Exception as exc:
        raise tls.AlertBadCertificate(f"certificate could not be checked: {exc}") from exc
    if not auth.allowed_sans:
        return identity
    for san in sans:
        if san in auth.allowed_sans:
            return san
    raise AlertAccessDenied("client certificate names no allowed SAN")


def _ignore(reason: Refusal) -> None:
    pass


class ClientVerifyingContext(tls.Context):
    """Server TLS context that demands and verifies a client certificate."""

    client_auth: ClientAuth
    on_refused: Callable[[Refusal], None]
    peer_identity: str | None = None

    def _server_handle_certificate(self, input_buf: Buffer) -> None:
        with self._reporting_refusal():
            super()._server_handle_certificate(input_buf)
            if self.state is not tls.State.SERVER_EXPECT_CERTIFICATE_VERIFY:  # it was empty
                raise AlertCertificateRequired("a client certificate is required")

    def _server_handle_certificate_verify(self, input_buf: Buffer) -> None:
        with self._reporting_refusal():
            # The signature first: it proves the client holds the certificate's key.
            super()._server_handle_certificate_verify(input_buf)
            assert self._peer_certificate is not None
            self.peer_identity = verify_client_certificate(
                self._peer_certificate, self._peer_certificate_chain, self.client_auth
            )

    def _server_handle_finished(self, input_buf: Buffer, output_buf: Buffer) -> None:
        with self._reporting_refusal():
            if self.peer_identity is None:  # a handshake path that skipped the certificate
                raise AlertCertificateRequired("a client certificate is required")
        super()._server_handle_finished(input_buf, output_buf)

    @contextlib.contextmanager
    def _reporting_refusal(self) -> Iterator[None]:
        try:
            yield
        except tls.Alert as alert:
            self.on_refused(
                _REFUSAL_BY_ALERT.get(type(alert), Refusal.UNTRUSTED_CLIENT_CERTIFICATE)
            )
            raise


def require_client_certificate(
    quic: QuicConnection,
    auth: ClientAuth,
    *,
    on_refused: Callable[[Refusal], None] = _ignore,
) -> None:
    """Make a server connection demand a trusted client certificate.

    Call before the connection receives its first datagram: aioquic builds the
    TLS context then, and this hook upgrades it in place.
    """
    initialize = quic._initialize

    def initialize_verifying(peer_cid: bytes) -> None:
        initialize(peer_cid)
        context = quic.tls
        context.__class__ = ClientVerifyingContext
        assert isinstance(context, ClientVerifyingContext)
        context.client_auth = auth
        context.on_refused = on_refused
        context._request_client_certificate = True

    quic._initialize = initialize_verifying  # type: ignore[method-assign]


def peer_identity(quic: QuicConnection) -> str | None:
    """The verified client identity of a connection, once its handshake got that far."""
    context = getattr(quic, "tls", None)
    return context.peer_identity if isinstance(context, ClientVerifyingContext) else None


def allowed_sans_from(names: Iterable[str]) -> frozenset[str]:
    """Configured SANs as `certificate_sans` reports them: DNS names (no colon) lowercased."""
    return frozenset(name if ":" in name else name.lower() for name in names)
