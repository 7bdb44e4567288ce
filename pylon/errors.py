"""Errors Pylon answers itself, and the one place httpx exceptions are mapped.

    PylonError                      (status, OpenAI error type, bounded code)
    ├── RequestRejected             the gateway's request is at fault (never retried)
    │   ├── BadTunnelHeader         400 missing/invalid x-request-id, malformed x-priority
    │   ├── BodyInvalid             400 body must be sanitized but is not a JSON object
    │   ├── RouteNotAllowed         404 route not on the backend's allow-list
    │   ├── BodyTooLarge            413 body over limits.max_body_bytes
    │   ├── Unauthorized            401 missing or unaccepted bearer token
    │   ├── BodyIdleTimeout         408 no body bytes in time (a reset once the engine saw some)
    │   ├── HeaderTooLarge          431 header section over limits.max_header_bytes
    │   ├── ConnectionStreamLimit   503 too many requests on this connection (retry elsewhere)
    │   ├── TotalStreamLimit        503 too many requests on this node (retry elsewhere)
    │   ├── TooEarly                425 non-idempotent request sent as replayable 0-RTT data
    │   └── Draining                503 Pylon is shutting down (retry elsewhere)
    └── UpstreamError               the engine side failed
        ├── UpstreamUnreachable     502 connect refused/unreachable (nothing sent: retry-safe)
        ├── UpstreamNotReady        503 no pooled connection free in time (retry-safe)
        ├── UpstreamReset           502 engine closed or broke the exchange
        ├── UpstreamProtocolError   502 engine spoke broken HTTP
        └── UpstreamTimeout         504 header, idle or total budget ran out

`retry_safe` means no request byte reached the engine; the response says so
in `x-pylon-retry-safe` so the gateway may retry elsewhere.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import ClassVar

import httpx
import orjson

RETRY_SAFE_HEADER = b"x-pylon-retry-safe"
ERROR_CODE_HEADER = b"x-pylon-error"


class PylonError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal"
    retry_safe: ClassVar[bool] = False

    def body(self) -> bytes:
        error = {"message": str(self), "type": self.error_type, "code": self.code}
        return orjson.dumps({"error": error})

    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        headers = [(b"content-type", b"application/json"), (ERROR_CODE_HEADER, self.code.encode())]
        if self.retry_safe:
            headers.append((RETRY_SAFE_HEADER, b"true"))
        return tuple(headers)


class RequestRejected(PylonError):
    status = 400
    error_type = "invalid_request_error"
    retry_safe = True


class BadTunnelHeader(RequestRejected):
    code = "bad_tunnel_header"


class BodyInvalid(RequestRejected):
    code = "body_invalid"


class RouteNotAllowed(RequestRejected):
    status = 404
    error_type = "not_found_error"
    code = "route_not_allowed"


class BodyTooLarge(RequestRejected):
    status = 413
    code = "body_too_large"


class Unauthorized(RequestRejected):
    status = 401
    error_type = "authentication_error"
    code = "unauthorized"

    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return (*super().headers(), (b"www-authenticate", b"Bearer"))


class BodyIdleTimeout(RequestRejected):
    """The gateway stopped sending the body: 408, or a stream reset once the
    engine has seen part of the request (a partial request must not look whole)."""

    status = 408
    code = "body_idle_timeout"

    def __init__(self, message: str, *, upstream_started: bool) -> None:
        super().__init__(message)
        self.upstream_started = upstream_started


class HeaderTooLarge(RequestRejected):
    status = 431
    code = "header_too_large"


class ConnectionStreamLimit(RequestRejected):
    status = 503
    error_type = "service_unavailable"
    code = "connection_stream_limit"


class TotalStreamLimit(RequestRejected):
    status = 503
    error_type = "service_unavailable"
    code = "total_stream_limit"


class TooEarly(RequestRejected):
    status = 425
    code = "too_early"


class Draining(RequestRejected):
    status = 503
    error_type = "service_unavailable"
    code = "draining"


class UpstreamError(PylonError):
    status = 502
    error_type = "upstream_error"
    kind: ClassVar[str] = "protocol"
    """Bounded metric label for the failure."""


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"
    retry_safe = True
    kind = "connect"


class UpstreamNotReady(UpstreamError):
    status = 503
    code = "upstream_not_ready"
    retry_safe = True
    kind = "not_ready"


class UpstreamReset(UpstreamError):
    code = "upstream_reset"
    kind = "reset"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
    kind = "timeout"


_HTTPX_ERRORS: tuple[tuple[type[Exception], type[UpstreamError]], ...] = (
    # Order matters: subclasses before their bases.
    (httpx.ConnectTimeout, UpstreamUnreachable),
    (httpx.PoolTimeout, UpstreamNotReady),
    (httpx.TimeoutException, UpstreamTimeout),
    (httpx.ConnectError, UpstreamUnreachable),
    (httpx.RemoteProtocolError, UpstreamReset),
    (httpx.ProtocolError, UpstreamProtocolError),
    (httpx.ReadError, UpstreamReset),
    (httpx.WriteError, UpstreamReset),
    (httpx.TransportError, UpstreamUnreachable),
)


def upstream_error_for(exc: Exception) -> UpstreamError:
    for httpx_type, pylon_type in _HTTPX_ERRORS:
        if isinstance(exc, httpx_type):
            return pylon_type(f"engine: {type(exc).__name__}: {exc}".rstrip(": "))
    return UpstreamProtocolError(f"engine: {type(exc).__name__}")


class _UpstreamErrorMap:
    """Translate httpx transport exceptions (and budget timeouts) into UpstreamError.

    A class, not `contextlib.asynccontextmanager`: it wraps every request twice, and
    a generator-based manager costs five times as much to enter and leave. It keeps
    no state, so one instance serves every use, nested or concurrent.
    """

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout("engine: time budget exceeded") from exc
        if isinstance(exc, httpx.TransportError):
            raise upstream_error_for(exc) from exc
        return False


_UPSTREAM_ERROR_MAP = _UpstreamErrorMap()


def map_upstream_errors() -> AbstractAsyncContextManager[None]:
    """Translate httpx transport exceptions (and budget timeouts) into UpstreamError."""
    return _UPSTREAM_ERROR_MAP
