"""The upstream edge: one pooled httpx transport, streaming both ways, with LLM-shaped budgets.

Requests go to the transport as `httpx.Request`s, not through an
`httpx.AsyncClient`: a client is a user agent, and a proxy must not be one. It
keeps a cookie jar (a Set-Cookie from the engine on one gateway request would
ride on every later request, whoever sent it) and adds default headers the
gateway did not send (`accept-encoding: gzip, deflate` would let the engine
compress an answer no one asked to be compressed). Skipping the client also
skips its URL merging and its redirect and auth machinery: 0.86x the CPU per
small request (docs/performance.md).

httpx's read timeout applies to every read, including the wait for the
response head, but time to first token can be minutes: so httpx gets no read
timeout, and Pylon enforces its own budgets here: an optional response-head
timeout, an idle timeout between body chunks, and (in the service) an optional
total deadline. Every httpx exception is translated by the one table in
`pylon.errors` (`map_upstream_errors` / `upstream_error_for`).

A request is sent a second time only when the first attempt died on a reused
pooled connection before its request head was written (the engine restarted
between two requests): then the engine cannot have seen it. Anything later is
never retried, because the engine may already be generating.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from pylon.config import UpstreamSettings
from pylon.errors import (
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
    map_upstream_errors,
    upstream_error_for,
)
from pylon.tunnel_headers import REQUEST_ID, strip_hop_by_hop
from pylon.upstream_pump import BodySink
from pylon.upstream_transport import H11Transport, ResponseBody

logger = logging.getLogger("pylon.forwarder")

PARSED_URLS_KEPT = 1024
"""Engine URLs kept parsed: a handful of paths in practice, bounded whatever gateways send."""

KEEPALIVE_EXPIRY_S = 30.0
"""Below common engine servers' idle keep-alive (uvicorn 5 s is the exception:
both transports discard connections the server already closed before reuse)."""


def upstream_limits(settings: UpstreamSettings) -> httpx.Limits:
    return httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )


UPSTREAM_TRANSPORTS: dict[str, Callable[[httpx.Limits], httpx.AsyncBaseTransport]] = {
    "h11": lambda limits: H11Transport(limits=limits),
    "httpcore": lambda limits: httpx.AsyncHTTPTransport(limits=limits, trust_env=False),
}
"""`upstream.transport` -> transport. "h11" is Pylon's own (about half httpcore's CPU,
docs/performance.md); httpcore is httpx's stock transport, kept as a fallback."""


def build_upstream_transport(settings: UpstreamSettings) -> httpx.AsyncBaseTransport:
    return UPSTREAM_TRANSPORTS[settings.transport](upstream_limits(settings))


def upstream_timeouts(settings: UpstreamSettings) -> httpx.Timeout:
    return httpx.Timeout(
        connect=settings.connect_timeout_s,
        read=None,
        write=settings.idle_timeout_s,
        pool=settings.pool_timeout_s,
    )


def build_upstream_client(
    settings: UpstreamSettings, transport: httpx.AsyncBaseTransport
) -> httpx.AsyncClient:
    """A client on the forwarder's transport, for Pylon's own calls (the engine probe)."""
    return httpx.AsyncClient(
        transport=transport, timeout=upstream_timeouts(settings), trust_env=False
    )


@dataclass(frozen=True)
class UpstreamResponse:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    _response: httpx.Response
    _idle_timeout_s: float

    async def relay_to(self, sink: BodySink, *, on_first_chunk: Callable[[], None]) -> None:
        """The whole body into `sink`, then end it; the idle budget applies, `on_first_chunk`
        is called once the body starts. A body that fails leaves `sink` unended.

        The h11 transport pushes it from the socket callback (no task wake-up and
        no async-iterator chain per SSE event); any other transport is iterated.
        """
        stream = self._response.stream
        if isinstance(stream, ResponseBody):
            try:
                await stream.relay(
                    sink, idle_timeout_s=self._idle_timeout_s, on_first_chunk=on_first_chunk
                )
            except httpx.TimeoutException as exc:
                raise UpstreamTimeout("engine: idle between response chunks") from exc
            except httpx.TransportError as exc:
                raise upstream_error_for(exc) from exc
            return
        first = True
        async for chunk in self.chunks():
            if first:
                on_first_chunk()
                first = False
            if not sink.write(chunk):
                await sink.wait_drained()
        sink.end()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes exactly as the engine sent them, one chunk per socket read."""
        # The transport's byte stream itself: `Response.aiter_raw` would only add a
        # generator per chunk (re-chunking and byte counting, both unused here).
        stream = self._response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        raw = aiter(stream)
        watchdog = IdleWatchdog(self._idle_timeout_s)
        try:
            while True:
                watchdog.waiting()
                try:
                    chunk = await anext(raw)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if watchdog.fired and watchdog.owns_cancellation():
                        raise UpstreamTimeout("engine: idle between response chunks") from None
                    raise
                except httpx.TransportError as exc:
                    raise upstream_error_for(exc) from exc
                watchdog.idle()
                yield chunk
        finally:
            watchdog.stop()


class IdleWatchdog:
    """Cancels the reading task when the engine has been silent for `idle_s`.

    One timer per idle period instead of one `asyncio.timeout` per chunk: an
    SSE stream has a chunk per token, and a timer per token was a measurable
    share of Pylon's CPU. Only time spent waiting for the engine counts; time
    spent waiting for a slow gateway to drain does not.
    """

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._waiting_since: float | None = None
        self.fired = False
        self._handle = self._loop.call_later(idle_s, self._check)

    def waiting(self) -> None:
        self._waiting_since = self._loop.time()

    def idle(self) -> None:
        self._waiting_since = None

    def stop(self) -> None:
        self._handle.cancel()

    def owns_cancellation(self) -> bool:
        """True if this watchdog's cancel is the only one pending on the task."""
        return self._task is not None and self._task.uncancel() == 0

    def _check(self) -> None:
        if self._waiting_since is None:
            self._handle = self._loop.call_later(self._idle_s, self._check)
            return
        remaining = self._waiting_since + self._idle_s - self._loop.time()
        if remaining > 0:
            self._handle = self._loop.call_later(remaining, self._check)
        elif self._task is not None:
            self.fired = True
            self._task.cancel()


def response_headers(
    response: httpx.Response, request_id: str | None
) -> tuple[tuple[bytes, bytes], ...]:
    """Engine headers minus hop-by-hop fields, with our request id echoed exactly once."""
    raw = response.headers.raw
    kept = [(name, value) for name, value in strip_hop_by_hop(raw) if name != REQUEST_ID]
    if request_id is not None:
        kept.append((REQUEST_ID, request_id.encode("ascii")))
    # Raw bytes are relayed, so the engine's length holds. Read from the raw list:
    # httpx's lookup lowercases every name and guesses the encoding per question.
    lengths = [value for name, value in raw if name.lower() == b"content-length"]
    if lengths:
        kept.append((b"content-length", b", ".join(lengths)))
    return tuple(kept)


def parse_target(url: str) -> tuple[httpx.URL, bytes]:
    """The engine URL parsed, and its Host header (the port only when not the default)."""
    parsed = httpx.URL(url)
    return parsed, parsed.netloc


BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Methods that declare an empty body as `content-length: 0` (as httpx and browsers do)."""


def framing_headers(
    method: str, content: bytes | AsyncIterable[bytes]
) -> list[tuple[bytes, bytes]]:
    """How the body is framed upstream, as httpx frames `content=`: a length for bytes,
    chunked for a stream. Set here so each request skips httpx's header preparation
    (11 µs of the 14 it took to build a request, docs/performance.md)."""
    if not isinstance(content, bytes):
        return [(b"transfer-encoding", b"chunked")]
    if content or method in BODY_METHODS:
        return [(b"content-length", b"%d" % len(content))]
    return []


class RequestBodyStream(httpx.AsyncByteStream):
    """A streamed request body in the type httpx transports take."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk


@dataclass
class AttemptTrace:
    """What the transport reported about one attempt, through the `trace` request
    extension (httpcore's event names; `H11Transport` emits the same)."""

    new_connection: bool = False
    """A TCP connection was opened for this attempt (else a pooled one was reused)."""
    head_unsent: bool = False
    """Writing the request head failed, so the engine cannot have parsed the request."""

    async def __call__(self, event: str, info: Mapping[str, Any]) -> None:
        if event == "connection.connect_tcp.started":
            self.new_connection = True
        elif event == "http11.send_request_headers.failed":
            self.head_unsent = True


class _Exchange:
    """`Forwarder.exchange` as a class: a generator-based context manager costs five
    times as much to enter and leave, and every request makes one."""

    __slots__ = ("_idle_timeout_s", "_open", "_request_id", "_response")

    def __init__(
        self,
        open_response: Callable[[], Awaitable[httpx.Response]],
        *,
        request_id: str | None,
        idle_timeout_s: float,
    ) -> None:
        self._open = open_response
        self._request_id = request_id
        self._idle_timeout_s = idle_timeout_s
        self._response: httpx.Response | None = None

    async def __aenter__(self) -> UpstreamResponse:
        response = self._response = await self._open()
        try:
            return UpstreamResponse(
                status=response.status_code,
                headers=response_headers(response, self._request_id),
                _response=response,
                _idle_timeout_s=self._idle_timeout_s,
            )
        except BaseException:
            await response.aclose()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Closing an unfinished response closes its connection: the engine
        # sees the disconnect and stops generating.
        assert self._response is not None
        await self._response.aclose()


class Forwarder:
    def __init__(self, transport: httpx.AsyncBaseTransport, settings: UpstreamSettings) -> None:
        if settings.url is None:
            raise ValueError("upstream.url is required")
        self._transport = transport
        self._base_url = settings.url
        # Parsing the URL was over half of building each request (docs/performance.md);
        # httpx.URL is immutable, so one parse serves every request to that path.
        self._parsed_url = functools.lru_cache(maxsize=PARSED_URLS_KEPT)(parse_target)
        self._settings = settings
        self._timeouts = upstream_timeouts(settings).as_dict()

    def exchange(
        self,
        *,
        method: str,
        path: str,
        headers: tuple[tuple[bytes, bytes], ...],
        content: bytes | AsyncIterable[bytes],
        request_id: str | None,
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """The engine's response head on entry; on exit its connection goes back to
        the pool, or is closed if the body is unfinished."""
        return _Exchange(
            functools.partial(self._open, method, self._base_url + path, headers, content),
            request_id=request_id,
            idle_timeout_s=self._settings.idle_timeout_s,
        )

    async def _open(
        self,
        method: str,
        url: str,
        headers: tuple[tuple[bytes, bytes], ...],
        content: bytes | AsyncIterable[bytes],
    ) -> httpx.Response:
        async with map_upstream_errors():
            deadline_s = self._settings.response_header_timeout_s
            if deadline_s is None:  # the default: no timer, and no context to enter for it
                return await self._send(method, url, headers=headers, content=content)
            try:
                async with asyncio.timeout(deadline_s):
                    return await self._send(method, url, headers=headers, content=content)
            except TimeoutError as exc:
                raise UpstreamTimeout("engine: no response head in time") from exc

    async def _send(
        self,
        method: str,
        url: str,
        *,
        headers: tuple[tuple[bytes, bytes], ...],
        content: bytes | AsyncIterable[bytes],
    ) -> httpx.Response:
        """Send; once more if a reused connection was dead before the head went out.

        The body is sent after the head, so a streamed body is still unread then.
        """
        target, host = self._parsed_url(url)
        framed_headers = [(b"host", host), *headers, *framing_headers(method, content)]
        for attempt in range(2):
            trace = AttemptTrace()
            request = httpx.Request(
                method,
                target,
                headers=framed_headers,
                stream=httpx.ByteStream(content)
                if isinstance(content, bytes)
                else RequestBodyStream(content),
                extensions={"trace": trace, "timeout": self._timeouts},
            )
            try:
                async with map_upstream_errors():
                    response = await self._transport.handle_async_request(request)
                response.request = request
                return response
            except UpstreamError as error:
                if not trace.head_unsent:
                    raise
                if attempt or trace.new_connection:
                    raise UpstreamUnreachable(
                        "engine: closed before the request was sent"
                    ) from error
                logger.warning(
                    "engine closed a pooled connection before the request; retrying once"
                )
        raise AssertionError("unreachable")
