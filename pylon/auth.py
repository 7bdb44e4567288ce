"""Who and what may use the tunnel: start-up policy, client CA, bearer tokens, admission.

Strategy: authentication is required outside `--dev`: a client certificate
chaining to `auth.client_ca_file` (checked in the TLS handshake, see
`tunnel/tls.py`), a bearer token from `auth.token_file` (checked here on every
request), or both. Running with neither needs the explicit
`auth.insecure_no_auth`, which is logged as a warning at every start.

Tokens are read from a file, one per line (blank lines and `#` comments
ignored), and re-read when the file changes (mtime, size or inode), so a
rotation needs no restart. A file that cannot be read keeps the last good
set (and logs once); an empty file accepts no token at all. Tokens are kept
as SHA-256 digests and compared in constant time (`hmac.compare_digest`)
against every configured one, so neither a token's length nor which token
matched shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pylon.config import AuthSettings, Settings
from pylon.errors import (
    ConnectionStreamLimit,
    HeaderTooLarge,
    RequestRejected,
    TotalStreamLimit,
    Unauthorized,
)
from pylon.pipeline import header_section_size
from tunnel.stream import StreamLimit, TunnelStream
from tunnel.tls import ClientAuth, allowed_sans_from, load_ca_bundle

__all__ = [
    "AUTHORIZATION",
    "Admission",
    "AuthSetupError",
    "TokenFile",
    "TunnelAuth",
    "bearer_token",
    "client_auth_from",
    "require_configured_auth",
    "token_accepted",
    "token_digest",
    "tunnel_auth_from",
]

logger = logging.getLogger("pylon.auth")

AUTHORIZATION = b"authorization"
_BEARER = b"bearer"


ZERO_RTT_REFUSAL = (
    "security.enable_0rtt cannot be combined with --client-ca: a resumed TLS session "
    "skips the client-certificate check; use token authentication with 0-RTT"
)


class AuthSetupError(Exception):
    """Authentication settings that cannot run (missing file, no method outside --dev)."""


@dataclass(frozen=True)
class TunnelAuth:
    client: ClientAuth | None
    """Client-certificate requirement for the QUIC handshake, if configured."""
    tokens: TokenFile | None
    """Accepted bearer tokens, if configured."""


def tunnel_auth_from(settings: Settings) -> TunnelAuth:
    """The configured authentication, after refusing settings that cannot run safely."""
    if settings.security.enable_0rtt and settings.auth.client_ca_file is not None:
        raise AuthSetupError(ZERO_RTT_REFUSAL)
    require_configured_auth(settings.auth, dev=settings.dev)
    token_file = settings.auth.token_file
    tokens = TokenFile(token_file) if token_file is not None else None
    return TunnelAuth(client=client_auth_from(settings.auth), tokens=tokens)


def require_configured_auth(settings: AuthSettings, *, dev: bool) -> None:
    """Refuse to run unauthenticated unless --dev or the explicit insecure switch says so."""
    configured = settings.client_ca_file is not None or settings.token_file is not None
    if configured or dev:
        return
    if not settings.insecure_no_auth:
        raise AuthSetupError(
            "tunnel authentication is required: --client-ca FILE and/or --token-file FILE "
            "(or --insecure-no-auth to run without any, never in production)"
        )
    logger.warning(
        "INSECURE: tunnel authentication is off (--insecure-no-auth): anyone who can reach "
        "the tunnel port can send requests to the engine"
    )


def client_auth_from(settings: AuthSettings) -> ClientAuth | None:
    if settings.client_ca_file is None:
        return None
    try:
        bundle = load_ca_bundle(settings.client_ca_file)
    except (OSError, ValueError) as exc:
        raise AuthSetupError(f"cannot load client CA {settings.client_ca_file}: {exc}") from exc
    return ClientAuth(ca_pem=bundle, allowed_sans=allowed_sans_from(settings.allowed_sans))


def parse_tokens(text: bytes) -> tuple[bytes, ...]:
    lines = (line.strip() for line in text.splitlines())
    return tuple(line for line in lines if line and not line.startswith(b"#"))


def token_digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the one `authorization: Bearer <token>` header, else None."""
    values = [value for name, value in headers if name.lower() == AUTHORIZATION]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    if scheme.lower() != _BEARER:
        return None
    token = token.strip()
    return token or None


def token_accepted(presented: bytes | None, digests: Iterable[bytes]) -> bool:
    """Constant-time against each token digest; every one is compared, match or not."""
    if presented is None:
        return False
    wanted = token_digest(presented)
    accepted = False
    for digest in digests:
        accepted |= hmac.compare_digest(wanted, digest)
    return accepted


@dataclass(frozen=True)
class _Loaded:
    identity: tuple[int, int, int]
    """(mtime_ns, size, inode): a change in any of them means the file was rewritten."""
    digests: tuple[bytes, ...]


class TokenFile:
    """The accepted bearer tokens, re-read whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._unreadable = False
        try:
            self._loaded = self._load()
        except OSError as exc:
            raise AuthSetupError(f"cannot read token file {path}: {exc}") from exc
        if not self._loaded.digests:
            raise AuthSetupError(f"token file {path} holds no token")

    def _load(self) -> _Loaded:
        with self.path.open("rb") as file:
            identity = _identity(os.fstat(file.fileno()))
            digests = tuple(token_digest(token) for token in parse_tokens(file.read()))
        return _Loaded(identity, digests)

    def digests(self) -> tuple[bytes, ...]:
        """Digests of the accepted tokens, re-reading the file if it changed."""
        try:
            if _identity(self.path.stat()) != self._loaded.identity:
                self._loaded = self._load()
                logger.info("token file re-read", extra={"tokens": len(self._loaded.digests)})
        except OSError as exc:
            if not self._unreadable:
                logger.error("token file unreadable, keeping the previous tokens: %s", exc)
            self._unreadable = True
        else:
            self._unreadable = False
        return self._loaded.digests

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raise Unauthorized unless the request carries an accepted bearer token."""
        presented = bearer_token(headers)
        if presented is None:
            raise Unauthorized("missing bearer token (authorization: Bearer <token>)")
        if not token_accepted(presented, self.digests()):
            raise Unauthorized("bearer token not accepted")


def _identity(stat: os.stat_result) -> tuple[int, int, int]:
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


_OVER_LIMIT: dict[StreamLimit, type[RequestRejected]] = {
    StreamLimit.PER_CONNECTION: ConnectionStreamLimit,
    StreamLimit.TOTAL: TotalStreamLimit,
}


@dataclass(frozen=True)
class Admission:
    """What every request must pass before it is planned, cheapest check first."""

    max_header_bytes: int | None = None
    tokens: TokenFile | None = None
    """Bearer tokens, when token authentication is on."""

    def check(self, stream: TunnelStream) -> None:
        if stream.over_limit is not None:
            raise _OVER_LIMIT[stream.over_limit](
                f"too many concurrent requests ({stream.over_limit.value} limit); retry elsewhere"
            )
        size = header_section_size(stream.head)
        if self.max_header_bytes is not None and size > self.max_header_bytes:
            raise HeaderTooLarge(f"header section of {size} bytes exceeds {self.max_header_bytes}")
        if self.tokens is not None:
            self.tokens.check(stream.head.headers)
