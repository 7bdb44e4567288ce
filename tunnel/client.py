"""An HTTP/3 client that plays the gateway: for `pylon call`, tests and benches.

Strategy: one QUIC connection carries many concurrent requests; each request
is a stream whose response head and body chunks are delivered through an
asyncio queue as they arrive, so a caller sees streamed tokens as soon as the
tunnel sends them. A stream reset from the server surfaces as `StreamAborted`
on the reader, never as a clean end. Header lists are sent exactly as given,
so tests can send malformed requests on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

from tunnel.flow import ConsumptionCredit
from tunnel.types import HeaderList, StreamAborted

_END = object()


@dataclass
class ClientResponse:
    """A response being received; iterate `chunks()` for the body as it arrives."""

    stream_id: int
    status: int
    headers: HeaderList
    _queue: asyncio.Queue[Any] = field(repr=False)
    _client: H3Client = field(repr=False)

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, StreamAborted):
                raise item
            self._client.consumed(self.stream_id, len(item))
            yield item

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def reset(self) -> None:
        """Abandon the response (the caller went away)."""
        self._client.reset_stream(self.stream_id)


class H3Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h3 = H3Connection(self._quic)
        self._heads: dict[int, asyncio.Future[tuple[int, HeaderList]]] = {}
        self._responses: dict[
            int, tuple[asyncio.Future[tuple[int, HeaderList]], asyncio.Queue[Any]]
        ] = {}
        """Body queues kept until `response()` collects them, even if the stream ended."""
        self._bodies: dict[int, asyncio.Queue[Any]] = {}
        self._credits: dict[int, ConsumptionCredit] = {}
        """One credit per window size; each limits only the streams it tracks."""
        self._stream_credits: dict[int, ConsumptionCredit] = {}
        self._default_window: int | None = None
        self._declined: set[int] = set()
        """Streams whose rest of the body the server declined (STOP_SENDING), e.g. after an
        early error response: sending more would be an HTTP/3 protocol error."""

    def limit_receive_window(self, window_bytes: int) -> None:
        """Grant response credit only as the caller reads: makes a slow reader really slow.

        Applies to every stream opened from now on; `request(receive_window_bytes=)`
        limits one stream only. aioquic otherwise grows the window as data
        arrives, whether read or not.
        """
        self._default_window = window_bytes

    def _limit_stream(self, stream_id: int, window_bytes: int) -> None:
        credit = self._credits.get(window_bytes)
        if credit is None:  # each credit chains to the previous one for streams it does not track
            credit = ConsumptionCredit(self._quic, window_bytes=window_bytes)
            self._credits[window_bytes] = credit
        credit.track(stream_id)
        self._stream_credits[stream_id] = credit

    def _forget_credit(self, stream_id: int) -> None:
        credit = self._stream_credits.pop(stream_id, None)
        if credit is not None:
            credit.forget(stream_id)

    def consumed(self, stream_id: int, byte_count: int) -> None:
        credit = self._stream_credits.get(stream_id)
        if credit is not None:
            credit.consumed(stream_id, byte_count)
            self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamReset):
            self._fail(event.stream_id, StreamAborted(event.error_code))
        elif isinstance(event, ConnectionTerminated):
            for stream_id in list(self._bodies):
                self._fail(stream_id, StreamAborted(event.error_code))
        elif isinstance(event, StopSendingReceived):
            self._declined.add(event.stream_id)
        for h3_event in self._h3.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            head = self._heads.get(event.stream_id)
            if head is not None and not head.done():
                status = int(dict(event.headers).get(b":status", b"0"))
                regular = tuple((k, v) for k, v in event.headers if not k.startswith(b":"))
                head.set_result((status, regular))
            if event.stream_ended:
                self._end(event.stream_id)
        elif isinstance(event, DataReceived):
            queue = self._bodies.get(event.stream_id)
            if queue is not None and event.data:
                credit = self._stream_credits.get(event.stream_id)
                if credit is not None:
                    credit.received(event.stream_id, len(event.data))
                queue.put_nowait(event.data)
            if event.stream_ended:
                self._end(event.stream_id)

    def _end(self, stream_id: int) -> None:
        self._forget_credit(stream_id)
        queue = self._bodies.pop(stream_id, None)
        if queue is not None:
            queue.put_nowait(_END)
        self._heads.pop(stream_id, None)

    def _fail(self, stream_id: int, error: StreamAborted) -> None:
        head = self._heads.pop(stream_id, None)
        if head is not None and not head.done():
            head.set_exception(error)
        queue = self._bodies.pop(stream_id, None)
        if queue is not None:
            queue.put_nowait(error)

    def reset_stream(self, stream_id: int) -> None:
        self._forget_credit(stream_id)
        self._bodies.pop(stream_id, None)
        self._heads.pop(stream_id, None)
        self._declined.discard(stream_id)
        with contextlib.suppress(Exception):
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()

    def open_request(
        self,
        headers: HeaderList,
        *,
        end: bool,
        body: bytes = b"",
        receive_window_bytes: int | None = None,
    ) -> int:
        """Send a raw header list on a new stream (no validation) and return its id.

        `body`, the start of the request body, leaves in the same transmit as the
        headers, as a gateway with the body at hand sends it; `end` ends the stream
        after it.
        """
        stream_id = self._quic.get_next_available_stream_id()
        head: asyncio.Future[tuple[int, HeaderList]] = self._loop.create_future()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._heads[stream_id], self._bodies[stream_id] = head, queue
        self._responses[stream_id] = (head, queue)
        window = receive_window_bytes or self._default_window
        if window is not None:
            self._limit_stream(stream_id, window)
        self._h3.send_headers(stream_id, list(headers), end_stream=end and not body)
        if body:
            self._h3.send_data(stream_id, body, end_stream=end)
        self.transmit()
        return stream_id

    def open_request_with_body(
        self,
        headers: HeaderList,
        body: bytes,
        *,
        chunk_size: int,
        receive_window_bytes: int | None = None,
    ) -> int:
        """`open_request` with the first `chunk_size` bytes of `body`, ending the stream if
        that is all of it; `send_rest_paced` sends the rest."""
        return self.open_request(
            headers,
            end=len(body) <= chunk_size,
            body=body[:chunk_size],
            receive_window_bytes=receive_window_bytes,
        )

    def send_body(self, stream_id: int, data: bytes, *, end: bool) -> bool:
        """Send more of the request body; False, sending nothing, once the server declined it."""
        if stream_id in self._declined:
            if end:
                self._declined.discard(stream_id)
            return False
        self._h3.send_data(stream_id, data, end_stream=end)
        self.transmit()
        return True

    async def response(self, stream_id: int) -> ClientResponse:
        head, queue = self._responses.pop(stream_id)
        status, headers = await head
        return ClientResponse(stream_id, status, headers, queue, self)

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
        authority: str = "pylon",
        chunk_size: int = 64 * 1024,
        receive_window_bytes: int | None = None,
    ) -> ClientResponse:
        head = (
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers),
        )
        body = body or b""
        stream_id = self.open_request_with_body(
            head, body, chunk_size=chunk_size, receive_window_bytes=receive_window_bytes
        )
        await self.send_rest_paced(stream_id, body, chunk_size=chunk_size)
        return await self.response(stream_id)

    async def send_rest_paced(self, stream_id: int, body: bytes, *, chunk_size: int) -> None:
        """Send `body` after its first `chunk_size` bytes, which `open_request_with_body` sent.

        One chunk per loop pass, so a large upload does not hold the loop. Stops
        early when the server declines the rest (it answered before reading it all).
        """
        view = memoryview(body)
        try:
            for offset in range(chunk_size, len(body), chunk_size):
                await asyncio.sleep(0)
                chunk = bytes(view[offset : offset + chunk_size])
                if not self.send_body(stream_id, chunk, end=offset + chunk_size >= len(body)):
                    return
        finally:
            self._declined.discard(stream_id)


def client_configuration(
    *,
    verify: bool = True,
    cafile: str | None = None,
    server_name: str | None = None,
    client_cert: tuple[str, str] | None = None,
) -> QuicConfiguration:
    """Client settings; `client_cert` is (certificate, key) for servers that require mTLS."""
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.verify_mode = ssl.CERT_REQUIRED if verify else ssl.CERT_NONE
    if cafile:
        configuration.load_verify_locations(cafile)
    if client_cert is not None:
        configuration.load_cert_chain(*client_cert)
    configuration.server_name = server_name
    return configuration


@contextlib.asynccontextmanager
async def open_client(
    host: str, port: int, *, configuration: QuicConfiguration
) -> AsyncIterator[H3Client]:
    async with connect(host, port, configuration=configuration, create_protocol=H3Client) as client:
        yield client  # type: ignore[misc]
