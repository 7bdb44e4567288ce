"""httpx's transport for the engine: HTTP/1.1 over asyncio streams (`pylon.upstream_request`
writes, llhttp reads).

Strategy: Pylon keeps `httpx.AsyncClient` as its client API and plugs this in
through httpx's documented `AsyncBaseTransport`. One exchange is: take a
connection from the `KeepAlivePool` (or a slot to open one), write the request
(`pylon.upstream_request`), read until the response head, and hand httpx a body stream that
yields each body chunk as the socket read it, with no re-buffering. A
connection returns to the pool only after both messages were complete;
anything else (early close, an error, cancellation at any await) closes it, so
the engine sees the disconnect and stops generating. Besides httpx's pull
iteration, the body offers `relay`, which pushes it into a sink from the
socket callback, with no task wake-up per chunk
(`pylon.upstream_pump`).

Failures surface as httpx's own exceptions, as httpcore would raise them
(`pylon.errors` maps those), and the `trace` request extension gets
httpcore's event names for what Pylon's retry rule needs: a new TCP
connection, and a request head that could not be written. The wire side of
one connection (and how an idle one notices bytes nobody asked for) is
`pylon.upstream_connection`.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import sys
from collections.abc import AsyncIterator, Callable, Mapping

import httpx

from pylon.upstream_connection import (
    OpenConnection,
    Trace,
    UpstreamConnection,
    describe_os_error,
    open_tcp,
)
from pylon.upstream_pool import KeepAlivePool, Origin, PoolClosed, PoolStats
from pylon.upstream_pump import BodySink, relay_body
from pylon.upstream_response import END_OF_BODY

DEFAULT_PORTS = {"http": 80, "https": 443}


class H11Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to the engine over pooled asyncio connections (see the module docstring)."""

    def __init__(
        self,
        *,
        limits: httpx.Limits,
        ssl_context: ssl.SSLContext | None = None,
        open_connection: OpenConnection = open_tcp,
    ) -> None:
        """`ssl_context` for https:// engines defaults to httpx's (certifi's CAs);
        `open_connection` is the network edge, which tests replace to inject failures."""
        self._pool: KeepAlivePool[UpstreamConnection] = KeepAlivePool(
            max_connections=_unbounded(limits.max_connections),
            max_keepalive=_unbounded(limits.max_keepalive_connections),
            keepalive_expiry_s=math.inf
            if limits.keepalive_expiry is None
            else limits.keepalive_expiry,
        )
        self._ssl_context = ssl_context
        self._open_connection = open_connection

    def stats(self) -> PoolStats:
        return self._pool.stats()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        trace: Trace | None = request.extensions.get("trace")
        connection = await self._connection(request, timeouts, trace)
        try:
            head = await connection.send_request(
                request, write_timeout_s=timeouts.get("write"), trace=trace
            )
            if head is None:
                head = await connection.receive_head(read_timeout_s=timeouts.get("read"))
        except BaseException:
            self._pool.discard(connection)
            raise
        return httpx.Response(
            head.status_code,
            headers=head.headers,
            stream=ResponseBody(connection, self._pool, read_timeout_s=timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    async def aclose(self) -> None:
        self._pool.close()

    async def _connection(
        self, request: httpx.Request, timeouts: Mapping[str, float | None], trace: Trace | None
    ) -> UpstreamConnection:
        origin = _origin(request.url)
        loop = asyncio.get_running_loop()
        try:
            pooled = await self._pool.acquire(
                origin, now=loop.time(), timeout_s=timeouts.get("pool")
            )
        except TimeoutError as exc:
            raise httpx.PoolTimeout("no engine connection free within the pool timeout") from exc
        except PoolClosed as exc:
            raise httpx.ConnectError(str(exc)) from exc
        if pooled is not None:
            return pooled
        try:
            connection = await self._connect(origin, timeouts.get("connect"), trace)
        except BaseException:
            self._pool.unused_slot()
            raise
        self._pool.opened(connection)
        return connection

    async def _connect(
        self, origin: Origin, timeout_s: float | None, trace: Trace | None
    ) -> UpstreamConnection:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            tls = self._ssl_context = self._ssl_context or httpx.create_ssl_context()
        if trace is not None:
            info = {"host": host, "port": port, "local_address": None, "timeout": timeout_s}
            await trace("connection.connect_tcp.started", info)
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await self._open_connection(host, port, tls)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"engine {host}:{port}: no connection in time") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"engine {host}:{port}: {describe_os_error(exc)}") from exc
        connection = UpstreamConnection(origin, reader, writer)
        if trace is not None:
            await trace("connection.connect_tcp.complete", {"return_value": connection})
        return connection


class ResponseBody(httpx.AsyncByteStream):
    """The response body as the socket delivers it; the connection's fate at the end."""

    def __init__(
        self,
        connection: UpstreamConnection,
        pool: KeepAlivePool[UpstreamConnection],
        *,
        read_timeout_s: float | None,
    ) -> None:
        self._connection: UpstreamConnection | None = connection
        self._pool = pool
        self._read_timeout_s = read_timeout_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            return
        complete = False
        try:
            while True:
                event = await connection.next_event(self._read_timeout_s)
                if type(event) is bytes:
                    yield event
                elif event is END_OF_BODY:
                    complete = True
                    return
                else:
                    raise httpx.RemoteProtocolError(f"engine sent {event!r} mid-body")
        finally:
            self._finish(reusable=complete)

    async def relay(
        self,
        sink: BodySink,
        *,
        idle_timeout_s: float | None,
        on_first_chunk: Callable[[], None],
    ) -> None:
        """The whole body into `sink`, pushed as the socket delivers it, then `sink.end()`.

        A body already consumed or closed relays nothing and leaves `sink` unended.
        """
        connection = self._connection
        if connection is None:
            return
        complete = False
        try:
            await relay_body(
                connection,
                sink,
                idle_timeout_s=_tighter(idle_timeout_s, self._read_timeout_s),
                on_first_chunk=on_first_chunk,
            )
            complete = True
        finally:
            self._finish(reusable=complete)

    async def aclose(self) -> None:
        """Before the end of the body this closes the connection: the engine stops generating."""
        self._finish(reusable=False)

    def _finish(self, *, reusable: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if reusable and connection.start_next_cycle():
            self._pool.release(connection, now=asyncio.get_running_loop().time())
        else:
            self._pool.discard(connection)


def _tighter(first: float | None, second: float | None) -> float | None:
    """The shorter of two optional timeouts (None is no limit)."""
    if first is None or second is None:
        return second if first is None else first
    return min(first, second)


def _unbounded(limit: int | None) -> int:
    """httpx.Limits spells "no limit" as None."""
    return sys.maxsize if limit is None else limit


def _origin(url: httpx.URL) -> Origin:
    if url.scheme not in DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"engine URL scheme {url.scheme!r} is not http or https")
    return url.scheme, url.host, url.port or DEFAULT_PORTS[url.scheme]
