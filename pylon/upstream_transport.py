"""httpx's transport for the engine: HTTP/1.1 with h11 over asyncio streams.

Strategy: Pylon keeps `httpx.AsyncClient` as its client API and plugs this in
through httpx's documented `AsyncBaseTransport`. One exchange is: take a
connection from the `KeepAlivePool` (or a slot to open one), write the request
with h11, read until the response head, and hand httpx a body stream that
yields each h11 `Data` as the socket read it, with no re-buffering. A
connection returns to the pool only after h11 saw both messages complete;
anything else (early close, an error, cancellation at any await) closes it, so
the engine sees the disconnect and stops generating.

Failures surface as httpx's own exceptions, as httpcore would raise them
(`pylon.errors` maps those), and the `trace` request extension gets
httpcore's event names for what Pylon's retry rule needs: a new TCP
connection, and a request head that could not be written.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import sys
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from typing import Any, SupportsIndex, cast

import h11
import httpx

from pylon.upstream_pool import KeepAlivePool, Origin, PoolClosed, PoolStats

READ_BYTES = 64 * 1024
"""Per socket read: as httpcore; an SSE event is far smaller, a buffered body a few reads."""

DEFAULT_PORTS = {"http": 80, "https": 443}


class UpstreamReader(asyncio.StreamReader):
    """A StreamReader that counts the bytes fed to it and yields them all before an error.

    asyncio offers no public way to see buffered bytes; the count lets a
    connection idle in the pool tell that the engine wrote to it unasked.
    And asyncio's reader raises a connection error ahead of the bytes still
    buffered, losing a response the engine sent just before a reset: here
    the error ends the stream like EOF, and `exception()` says why.
    """

    fed_bytes = 0
    _error: Exception | None = None

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.fed_bytes += len(cast(bytes, data))  # transports feed bytes; the stub says more
        super().feed_data(data)

    def set_exception(self, exc: Exception) -> None:
        self._error = exc
        self.feed_eof()

    def exception(self) -> Exception | None:
        return self._error


Streams = tuple[UpstreamReader, asyncio.StreamWriter]
OpenConnection = Callable[[str, int, ssl.SSLContext | None], Awaitable[Streams]]
Trace = Callable[[str, Mapping[str, Any]], Awaitable[None]]


async def open_tcp(host: str, port: int, tls: ssl.SSLContext | None) -> Streams:
    """As `asyncio.open_connection`, with an `UpstreamReader`."""
    loop = asyncio.get_running_loop()
    reader = UpstreamReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(
        lambda: protocol, host, port, ssl=tls, server_hostname=host if tls is not None else None
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class _Connection:
    """One HTTP/1.1 connection: asyncio streams and the h11 state machine for them."""

    def __init__(self, origin: Origin, reader: UpstreamReader, writer: asyncio.StreamWriter):
        self.origin = origin
        self._reader = reader
        self._writer = writer
        self._h11 = h11.Connection(h11.CLIENT)
        self._read_bytes = 0

    def alive(self) -> bool:
        """Between exchanges: open, and nothing arrived that no request asked for.

        Unread bytes on an idle connection (a 408 on idle timeout, say) would
        otherwise be read as the next request's response.
        """
        return not (
            self._reader.fed_bytes != self._read_bytes
            or self._reader.at_eof()
            or self._reader.exception() is not None
            or self._writer.transport.is_closing()
        )

    def close(self) -> None:
        self._writer.close()

    def start_next_cycle(self) -> bool:
        """Ready for another exchange, if h11 saw both messages complete and nothing after."""
        state = self._h11
        if state.our_state is not h11.DONE or state.their_state is not h11.DONE:
            return False
        state.start_next_cycle()
        return not state.trailing_data[0]

    async def send_request(
        self, request: httpx.Request, *, write_timeout_s: float | None, trace: Trace | None
    ) -> h11.Response | None:
        """Write the request; exceptions from a streamed body's own iterator pass through.

        Returns the response head when the engine answered and closed before it
        took the whole request (a 413 for a large upload); then the write failure
        is not the outcome, as with httpcore.
        """
        headers, body = _framed(request)
        data = self._encode(
            h11.Request(method=request.method, target=request.url.raw_path, headers=headers)
        )
        if isinstance(body, bytes):
            data += self._send_body(body)
        self._writer.write(data)
        if self._writer.transport.is_closing():
            # The first send failed outright: not a byte of the request left.
            error = httpx.WriteError("engine closed the connection before the request")
            if trace is not None:
                await trace("http11.send_request_headers.failed", {"exception": error})
            raise error
        try:
            await self._drain(write_timeout_s)
            if not isinstance(body, bytes):
                await self._send_stream(body, write_timeout_s)
        except httpx.WriteError:
            head = await self._early_response()
            if head is None:
                raise
            return head
        return None

    async def _send_stream(self, body: AsyncIterable[bytes], write_timeout_s: float | None) -> None:
        async for chunk in body:
            self._writer.write(self._send_body(chunk, end=False))
            await self._drain(write_timeout_s)
        self._writer.write(self._send_body(b""))
        await self._drain(write_timeout_s)

    async def _early_response(self) -> h11.Response | None:
        """After a failed write: the response head, if the engine sent one before it closed.

        The connection is lost already; the abort makes sure of it, so the read
        takes what arrived and never waits for more.
        """
        self._writer.transport.abort()
        try:
            return await self.receive_head(read_timeout_s=None)
        except httpx.TransportError:
            return None

    async def receive_head(self, *, read_timeout_s: float | None) -> h11.Response:
        while True:
            event = await self.next_event(read_timeout_s)
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise httpx.RemoteProtocolError("engine closed the connection without a response")

    async def next_event(self, read_timeout_s: float | None) -> Any:
        try:
            while (event := self._h11.next_event()) is h11.NEED_DATA:
                if read_timeout_s is None:
                    data = await self._reader.read(READ_BYTES)
                else:
                    async with asyncio.timeout(read_timeout_s):
                        data = await self._reader.read(READ_BYTES)
                if not data and (error := self._reader.exception()) is not None:
                    raise error
                self._read_bytes += len(data)
                self._h11.receive_data(data)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("engine sent nothing within the read timeout") from exc
        except OSError as exc:
            raise httpx.ReadError(_describe(exc)) from exc
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc
        return event

    def _send_body(self, chunk: bytes, *, end: bool = True) -> bytes:
        data = self._encode(h11.Data(data=chunk)) if chunk else b""
        return data + self._encode(h11.EndOfMessage()) if end else data

    def _encode(self, event: h11.Request | h11.Data | h11.EndOfMessage) -> bytes:
        try:
            return self._h11.send(event) or b""
        except h11.LocalProtocolError as exc:
            raise httpx.LocalProtocolError(str(exc)) from exc

    async def _drain(self, timeout_s: float | None) -> None:
        try:
            # Only a full send buffer can make drain wait: skip the timer otherwise.
            if timeout_s is None or not self._writer.transport.get_write_buffer_size():
                await self._writer.drain()
            else:
                async with asyncio.timeout(timeout_s):
                    await self._writer.drain()
        except TimeoutError as exc:
            raise httpx.WriteTimeout("engine took nothing within the write timeout") from exc
        except OSError as exc:
            raise httpx.WriteError(_describe(exc)) from exc


def _describe(exc: OSError) -> str:
    return str(exc) or type(exc).__name__


def _framed(
    request: httpx.Request,
) -> tuple[list[tuple[bytes, bytes]], bytes | AsyncIterable[bytes]]:
    """Headers and body for h11: Content-Length when the headers carry it, else chunked."""
    headers = request.headers.raw
    stream = request.stream
    body: bytes | AsyncIterable[bytes]
    if isinstance(stream, httpx.ByteStream):
        body = b"".join(stream)
    elif isinstance(stream, bytes | bytearray | memoryview):
        body = bytes(stream)
    elif isinstance(stream, AsyncIterable):
        body = stream
    else:
        raise TypeError(f"request body must be bytes or async iterable, not {type(stream)}")
    framed = "content-length" in request.headers or "transfer-encoding" in request.headers
    if not framed:
        if not isinstance(body, bytes):
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        elif body:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
    return headers, body


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
        self._pool: KeepAlivePool[_Connection] = KeepAlivePool(
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
            headers=head.headers.raw_items(),
            stream=_ResponseBody(connection, self._pool, read_timeout_s=timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    async def aclose(self) -> None:
        self._pool.close()

    async def _connection(
        self, request: httpx.Request, timeouts: Mapping[str, float | None], trace: Trace | None
    ) -> _Connection:
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
    ) -> _Connection:
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
            raise httpx.ConnectError(f"engine {host}:{port}: {_describe(exc)}") from exc
        connection = _Connection(origin, reader, writer)
        if trace is not None:
            await trace("connection.connect_tcp.complete", {"return_value": connection})
        return connection


class _ResponseBody(httpx.AsyncByteStream):
    """The response body as the socket delivers it; the connection's fate at the end."""

    def __init__(
        self,
        connection: _Connection,
        pool: KeepAlivePool[_Connection],
        *,
        read_timeout_s: float | None,
    ) -> None:
        self._connection: _Connection | None = connection
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
                if type(event) is h11.Data:
                    yield bytes(event.data)
                elif type(event) is h11.EndOfMessage:
                    complete = True
                    return
                else:
                    raise httpx.RemoteProtocolError(f"engine sent {type(event).__name__} mid-body")
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


def _unbounded(limit: int | None) -> int:
    """httpx.Limits spells "no limit" as None."""
    return sys.maxsize if limit is None else limit


def _origin(url: httpx.URL) -> Origin:
    if url.scheme not in DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"engine URL scheme {url.scheme!r} is not http or https")
    return url.scheme, url.host, url.port or DEFAULT_PORTS[url.scheme]
