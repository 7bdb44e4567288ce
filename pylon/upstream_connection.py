"""One HTTP/1.1 connection to the engine: asyncio streams, the request encoded by
`pylon.upstream_request`, the response parsed by llhttp.

Strategy: `open_tcp` builds the streams itself (as `asyncio.open_connection`
does) so the reader is an `UpstreamReader`, which counts what the socket fed
it and keeps bytes that arrived before a connection error readable ahead of
the error. The count is what lets a connection idle in the pool tell that the
engine wrote to it unasked (a 408 on idle timeout) and be closed rather than
have that read as the next response; reading past an error is what lets a
response the engine sent before closing on an unfinished upload (a 413) be
returned, as httpcore does, instead of the write failure.

`H11Transport` (pylon.upstream_transport) drives one exchange at a time
through `send_request`, `receive_head` and `next_event` (or, for a streamed
body, `pylon.upstream_pump.relay_body`); failures surface as httpx's
exceptions, and a head that could not be written is reported to the `trace`
extension under httpcore's event name.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import httpx

from pylon.upstream_pool import Origin
from pylon.upstream_request import BodyFraming, RequestEncodingError, encode_request_head
from pylon.upstream_response import NEED_DATA, ResponseEvent, ResponseHead, ResponseParser

if TYPE_CHECKING:
    from pylon.upstream_pump import BodyPump

READ_BYTES = 64 * 1024
"""Per socket read: as httpcore; an SSE event is far smaller, a buffered body a few reads."""


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
    pump: BodyPump | None = None
    """While set, what the socket delivers goes to the pump, not to the buffer."""

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.fed_bytes += len(cast(bytes, data))  # transports feed bytes; the stub says more
        if self.pump is not None:
            self.pump.received(cast(bytes, data))
            return
        super().feed_data(data)

    def feed_eof(self) -> None:
        super().feed_eof()
        if self.pump is not None:
            self.pump.ended()

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


class UpstreamConnection:
    """One HTTP/1.1 connection: asyncio streams, and per exchange the request's `BodyFraming`
    and a `ResponseParser` that reads the response."""

    def __init__(self, origin: Origin, reader: UpstreamReader, writer: asyncio.StreamWriter):
        self.origin = origin
        self._reader = reader
        self._writer = writer
        self._body = BodyFraming(0)
        self._response = ResponseParser()
        self._read_bytes = 0

    @property
    def transport(self) -> asyncio.Transport:
        return cast(asyncio.Transport, self._writer.transport)  # a TCP transport reads too

    @property
    def reader(self) -> UpstreamReader:
        return self._reader

    @property
    def response(self) -> ResponseParser:
        """This exchange's response parser."""
        return self._response

    def count_read(self, byte_count: int) -> None:
        """Bytes taken from the socket by a reader other than `next_event` (the pump)."""
        self._read_bytes += byte_count

    def buffered_bytes(self) -> int:
        """Bytes the socket delivered that nothing has read yet."""
        return self._reader.fed_bytes - self._read_bytes

    def alive(self) -> bool:
        """Between exchanges: open, and nothing arrived that no request asked for.

        Unread bytes on an idle connection (a 408 on idle timeout, say) would
        otherwise be read as the next request's response.
        """
        return not (
            self.buffered_bytes() != 0
            or self._reader.at_eof()
            or self._reader.exception() is not None
            or self._writer.transport.is_closing()
        )

    def close(self) -> None:
        self._writer.close()

    def start_next_cycle(self) -> bool:
        """Ready for another exchange: the request all sent, the response complete, nothing
        after it, and neither side asked to close."""
        return self._body.complete and self._response.reusable

    async def send_request(
        self, request: httpx.Request, *, write_timeout_s: float | None, trace: Trace | None
    ) -> ResponseHead | None:
        """Write the request; exceptions from a streamed body's own iterator pass through.

        Returns the response head when the engine answered and closed before it
        took the whole request (a 413 for a large upload); then the write failure
        is not the outcome, as with httpcore.
        """
        headers, body = _framed(request)
        self._response = ResponseParser(head_request=request.method == "HEAD")
        try:
            data, self._body = encode_request_head(request.method, request.url.raw_path, headers)
        except RequestEncodingError as exc:
            raise httpx.LocalProtocolError(str(exc)) from exc
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

    async def _early_response(self) -> ResponseHead | None:
        """After a failed write: the response head, if the engine sent one before it closed.

        The connection is lost already; the abort makes sure of it, so the read
        takes what arrived and never waits for more.
        """
        self._writer.transport.abort()
        try:
            return await self.receive_head(read_timeout_s=None)
        except httpx.TransportError:
            return None

    async def receive_head(self, *, read_timeout_s: float | None) -> ResponseHead:
        event = await self.next_event(read_timeout_s)  # 1xx heads are skipped by the parser
        assert isinstance(event, ResponseHead)
        return event

    async def next_event(self, read_timeout_s: float | None) -> ResponseEvent:
        """The response's next event: its head, a body chunk (bytes), or END_OF_BODY."""
        try:
            while (event := self._response.next_event()) is NEED_DATA:
                if read_timeout_s is None:
                    data = await self._reader.read(READ_BYTES)
                else:
                    async with asyncio.timeout(read_timeout_s):
                        data = await self._reader.read(READ_BYTES)
                if not data and (error := self._reader.exception()) is not None:
                    raise error
                self._read_bytes += len(data)
                if data:
                    self._response.receive_data(data)
                else:
                    self._response.receive_eof()
        except TimeoutError as exc:
            raise httpx.ReadTimeout("engine sent nothing within the read timeout") from exc
        except OSError as exc:
            raise httpx.ReadError(describe_os_error(exc)) from exc
        return event

    def _send_body(self, chunk: bytes, *, end: bool = True) -> bytes:
        try:
            data = self._body.encode(chunk)
            return data + self._body.end() if end else data
        except RequestEncodingError as exc:
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
            raise httpx.WriteError(describe_os_error(exc)) from exc


def describe_os_error(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


_FRAMING_FIELDS = (b"content-length", b"transfer-encoding")


def _declares_framing(headers: list[tuple[bytes, bytes]]) -> bool:
    # The raw list, not `in request.headers`: httpx's lookup lowercases every name
    # and guesses the encoding again for each question asked.
    return any(name.lower() in _FRAMING_FIELDS for name, _ in headers)


def _framed(
    request: httpx.Request,
) -> tuple[list[tuple[bytes, bytes]], bytes | AsyncIterable[bytes]]:
    """Headers and body to write: Content-Length when the headers carry it, else chunked."""
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
    if not _declares_framing(headers):
        if not isinstance(body, bytes):
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        elif body:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
    return headers, body
