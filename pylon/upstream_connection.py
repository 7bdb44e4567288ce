"""One HTTP/1.1 connection to the engine: asyncio streams, h11 for the request, llhttp for the
response.

Strategy: `open_tcp` builds the streams itself (as `asyncio.open_connection`
does) so the reader is an `UpstreamReader`, which counts what the socket fed
it and keeps bytes that arrived before a connection error readable ahead of
the error. The count is what lets a connection idle in the pool tell that the
engine wrote to it unasked (a 408 on idle timeout) and be closed rather than
have that read as the next response; reading past an error is what lets a
response the engine sent before closing on an unfinished upload (a 413) be
returned, as httpcore does, instead of the write failure.

`H11Transport` (pylon.upstream_transport) drives one exchange at a time
through `send_request`, `receive_head` and `next_event` (or `relay_body`);
failures surface as httpx's exceptions, and a head that could not be written
is reported to the `trace` extension under httpcore's event name.

`relay_body` is the streaming fast path: a `BodyPump` feeds each socket read
to the `ResponseParser` inside the reader's `feed_data` callback and writes
the body chunks straight to a `BodySink` (the tunnel stream), so an SSE event
costs no task wake-up and no trip through a chain of async iterators. The
relaying task sleeps until the body ends, or until the sink is backlogged:
then the socket is not read until the sink drains, the same backpressure the
pull loop gives. Once the body is complete the pump lets go of the reader, so
bytes after it are buffered and counted as any unasked bytes are.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, SupportsIndex, cast

import h11
import httpx

from pylon.upstream_pool import Origin
from pylon.upstream_response import (
    END_OF_BODY,
    NEED_DATA,
    ResponseEvent,
    ResponseHead,
    ResponseParser,
)

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


class BodySink(Protocol):
    """Where `relay_body` writes a response body (the tunnel stream implements it)."""

    def write(self, data: bytes) -> bool:
        """Queue `data` without waiting; False once the sink is backlogged."""

    async def wait_drained(self) -> None:
        """Return once the sink takes more again."""


class BodyPump:
    """Feeds one response body from the socket callback into the parser and out to a sink.

    Runs inside `UpstreamReader.feed_data` and `feed_eof`, so nothing here
    awaits or raises: the outcome (complete, or the error that ended it) is
    left in `done` and `error`, and the relaying task is woken only when it
    must act.
    """

    def __init__(
        self,
        connection: UpstreamConnection,
        sink: BodySink,
        *,
        idle_timeout_s: float | None,
        on_first_chunk: Callable[[], None],
    ) -> None:
        self._connection = connection
        self._response = connection._response
        self._sink = sink
        self._loop = asyncio.get_running_loop()
        self._on_first_chunk: Callable[[], None] | None = on_first_chunk
        self._idle_timeout_s = idle_timeout_s
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_data_at = self._loop.time()
        self._wake: asyncio.Future[None] | None = None
        self._engine_closed = False
        """The reader ended (EOF or an error): once the parser runs dry, that decides."""
        self.done = False
        self.backlogged = False
        """The sink said stop: nothing more is written until the task has waited for it."""
        self._reading_paused = False
        self._unwritten = b""
        """Body bytes the parser gave out that the backlogged sink has not taken yet."""
        self.error: BaseException | None = None
        if idle_timeout_s is not None:
            self._idle_timer = self._loop.call_later(idle_timeout_s, self._check_idle)

    def received(self, data: bytes) -> None:
        """One socket read: counted as read, parsed, and written out unless backlogged."""
        self._connection._read_bytes += len(data)
        self._last_data_at = self._loop.time()
        try:
            self._response.receive_data(data)
        except Exception as exc:  # RemoteProtocolError; nothing may escape the socket callback
            self._finish(exc)
            return
        if not self.backlogged:  # else the parser keeps the events until `resume`
            self.parse()

    def ended(self) -> None:
        """The engine closed; it counts once the parser has given out what came before."""
        self._engine_closed = True
        if not self.backlogged:
            self.parse()

    def parse(self) -> None:
        """Write every body chunk the parser holds, until it needs data or the sink is full."""
        try:
            if self._unwritten:
                unwritten, self._unwritten = self._unwritten, b""
                if not self._write(unwritten):
                    self._pause()
                    return
            while not self.done:
                event = self._response.next_event()
                if type(event) is bytes:
                    if self._on_first_chunk is not None:
                        self._on_first_chunk()
                        self._on_first_chunk = None
                    if not self._write(event):
                        # Later events stay queued in the parser: the sink's cap
                        # overshoots by one piece, not by one whole socket read.
                        self._pause()
                        return
                elif event is END_OF_BODY:
                    self._finish(None)
                elif event is NEED_DATA:
                    if not self._engine_closed:
                        return
                    self._receive_end()
                else:
                    raise httpx.RemoteProtocolError(f"engine sent {event!r} mid-body")
        except Exception as exc:  # the parser's, or the sink's (the gateway reset): re-raised
            self._finish(exc)

    def _receive_end(self) -> None:
        """The reader's end, as `next_event` reads it: its error, else EOF for the parser
        (which ends a body delimited by the close and raises for any other)."""
        error = self._connection._reader.exception()
        if error is not None:
            raise httpx.ReadError(describe_os_error(error)) from error
        self._response.receive_eof()

    def _write(self, data: bytes) -> bool:
        """Write in pieces of at most READ_BYTES (what one pull read takes); once the
        sink is backlogged, keep the rest for `resume`."""
        if len(data) <= READ_BYTES:
            return self._sink.write(data)
        for offset in range(0, len(data), READ_BYTES):
            if not self._sink.write(data[offset : offset + READ_BYTES]):
                self._unwritten = data[offset + READ_BYTES :]
                return False
        return True

    async def wait(self) -> None:
        """Sleep until the body ended or the sink is backlogged."""
        if self.done or self.backlogged:
            return
        self._wake = self._loop.create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def resume(self) -> None:
        """The sink drained: write what the parser still holds, then read the socket again."""
        self.backlogged = False
        if self.done:  # ended by an error while backlogged: nothing more goes out
            return
        self._last_data_at = self._loop.time()
        self.parse()
        if not self.backlogged:
            self._resume_reading()

    def stop(self) -> None:
        """Detach from the socket, leaving the connection as a pull reader finds it."""
        self._connection._reader.pump = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._resume_reading()

    def _pause(self) -> None:
        self.backlogged = True
        if not self._reading_paused:
            self._reading_paused = True
            self._connection.transport.pause_reading()
        self._wake_task()

    def _resume_reading(self) -> None:
        transport = self._connection.transport
        if self._reading_paused and not transport.is_closing():
            transport.resume_reading()
        self._reading_paused = False

    def _finish(self, error: BaseException | None) -> None:
        self.done = True
        self.error = error
        self._connection._reader.pump = None  # bytes after the body are the pool's business
        self._wake_task()

    def _wake_task(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _check_idle(self) -> None:
        assert self._idle_timeout_s is not None
        if self.done:
            return
        remaining = self._last_data_at + self._idle_timeout_s - self._loop.time()
        if self.backlogged or remaining > 0:
            # Waiting for the gateway to drain is not the engine being silent.
            delay = self._idle_timeout_s if self.backlogged else remaining
            self._idle_timer = self._loop.call_later(delay, self._check_idle)
            return
        self._finish(httpx.ReadTimeout(f"engine silent for {self._idle_timeout_s} s mid-body"))


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
    """One HTTP/1.1 connection: asyncio streams, and per exchange an h11 state machine that
    writes the request and a `ResponseParser` that reads the response."""

    def __init__(self, origin: Origin, reader: UpstreamReader, writer: asyncio.StreamWriter):
        self.origin = origin
        self._reader = reader
        self._writer = writer
        self._h11 = h11.Connection(h11.CLIENT)
        self._response = ResponseParser()
        self._read_bytes = 0

    @property
    def transport(self) -> asyncio.Transport:
        return cast(asyncio.Transport, self._writer.transport)  # a TCP transport reads too

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
        """Ready for another exchange: the request all sent, the response complete, nothing
        after it, and neither side asked to close."""
        return self._h11.our_state is h11.DONE and self._response.reusable

    async def send_request(
        self, request: httpx.Request, *, write_timeout_s: float | None, trace: Trace | None
    ) -> ResponseHead | None:
        """Write the request; exceptions from a streamed body's own iterator pass through.

        Returns the response head when the engine answered and closed before it
        took the whole request (a 413 for a large upload); then the write failure
        is not the outcome, as with httpcore.
        """
        headers, body = _framed(request)
        self._h11 = h11.Connection(h11.CLIENT)
        self._response = ResponseParser(head_request=request.method == "HEAD")
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

    async def relay_body(
        self,
        sink: BodySink,
        *,
        idle_timeout_s: float | None,
        on_first_chunk: Callable[[], None],
    ) -> None:
        """Write the response body to `sink` as it arrives; return once it is complete.

        Raises httpx's exceptions as `next_event` would (a silent engine is a
        `ReadTimeout`), or whatever the sink raised.
        """
        pump = BodyPump(self, sink, idle_timeout_s=idle_timeout_s, on_first_chunk=on_first_chunk)
        try:
            buffered = self._reader.fed_bytes - self._read_bytes
            if buffered:  # came in with the head, so this read returns at once
                pump.received(await self._reader.readexactly(buffered))
            else:
                pump.parse()  # the parser may hold body chunks, even the whole body
            if not pump.done:
                self._reader.pump = pump
                if self._reader.at_eof():
                    pump.ended()
            while not pump.done:
                await pump.wait()
                if pump.backlogged and not pump.done:
                    await sink.wait_drained()
                    pump.resume()
        finally:
            pump.stop()
        if pump.error is not None:
            raise pump.error

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
            raise httpx.WriteError(describe_os_error(exc)) from exc


def describe_os_error(exc: Exception) -> str:
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
