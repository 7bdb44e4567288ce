"""One QUIC/HTTP3 connection's protocol: one handler task per request stream.

Strategy: aioquic's sans-IO connection does the protocol; this module is the
glue to asyncio. Every request stream becomes a `TunnelStream` handed to the
application handler in its own task. Peer resets cancel that task; a task that
fails after the response started resets the stream. Transmits are coalesced
to once per event-loop pass, because one send per SSE token costs several
times the CPU. Per-stream state is freed when a stream ends, since a tunnel
connection lives for days; a connection silent for `ping_interval_s` gets a
keep-alive PING, so NAT state survives a quiet spell and a dead peer is found.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import (
    H3_ALPN,
    ErrorCode,
    FrameType,
    encode_frame,
    stream_is_request_response,
)
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from tunnel.acks import delay_acknowledgements
from tunnel.flow import ConsumptionCredit, unacked_send_bytes
from tunnel.h3 import RequestMalformed, TunnelH3Connection
from tunnel.limits import (
    BoundedH3Connection,
    TunnelLimits,
    grant_peer_streams,
    oversized_header_frame,
    refuse_connection,
    stream_over_limit,
)
from tunnel.send_path import settled_without_packets, visit_only_busy_streams
from tunnel.steering import ConnectionIdSteering, steer_connection_ids
from tunnel.stream import READ_BATCH_BYTES, Handler, TunnelStream
from tunnel.tls import ClientAuth, peer_identity, require_client_certificate
from tunnel.types import HeaderList, MalformedRequest
from tunnel.validation import parse_request_head

if TYPE_CHECKING:
    from tunnel.listener import ConnectionRegistry

logger = logging.getLogger(__name__)

CONNECTION_LIMIT = "connection_limit"
"""Refusal reason: a connection over `TunnelLimits.max_connections`."""
HEADER_TOO_LARGE = "header_too_large"
"""Refusal reason: a HEADERS frame over `TunnelLimits.max_header_frame_bytes`."""
MALFORMED_REQUEST = "malformed_request"
"""Refusal reason: a request that breaks RFC 9114 message rules (stream reset)."""


def _ignore(reason: str) -> None:
    pass


def timer_can_stay(armed_at: float | None, deadline: float | None) -> bool:
    """Whether a timer armed for `armed_at` may serve the connection's next `deadline`.

    Firing early is harmless: aioquic's `handle_timer` acts only on deadlines
    that have passed, and the transmit after it arms the timer again. Firing
    late is not. Each packet sent or acknowledged moves the loss-detection
    deadline later, so keeping an earlier timer saves a cancel and a new
    timer (2 to 3 µs on uvloop) on nearly every transmit.
    """
    return armed_at is not None and deadline is not None and armed_at <= deadline


async def serve_stream(handler: Handler, stream: TunnelStream) -> None:
    """Run the handler on one request stream. A stream the handler left unfinished, or
    failed on, is reset: the gateway must never read a cut response as a whole one."""
    try:
        await handler(stream)
        if not stream.finished:
            stream.reset(ErrorCode.H3_INTERNAL_ERROR)
    except asyncio.CancelledError:
        stream.reset(ErrorCode.H3_REQUEST_CANCELLED)
    except Exception:
        logger.exception("handler failed on stream %d", stream.stream_id)
        stream.reset(ErrorCode.H3_INTERNAL_ERROR)


KEEPALIVE_PING_UID = 0
"""aioquic reports PING acknowledgements by uid; `ping()` waiters use id() values, never 0."""


@dataclass(frozen=True)
class TunnelOptions:
    max_queued_bytes_per_stream: int = 1 << 20
    """Unacknowledged response bytes a stream may hold before the writer waits."""
    request_window_bytes: int = 1 << 20
    """Request body bytes the peer may send ahead of what the handler has read."""
    ping_interval_s: float | None = None
    """PING a connection that has been silent this long (None: never)."""
    limits: TunnelLimits = field(default_factory=TunnelLimits)
    """Connections, concurrent streams and header frames (see `tunnel.limits`)."""
    client_auth: ClientAuth | None = None
    """Require a client certificate from this CA (mTLS); None accepts any client."""
    on_connection_refused: Callable[[str], None] = _ignore
    """Told the reason (a `Refusal` value or CONNECTION_LIMIT) of each refused connection."""
    on_stream_refused: Callable[[str], None] = _ignore
    """Told the reason of each request stream the tunnel itself refused
    (HEADER_TOO_LARGE, MALFORMED_REQUEST)."""
    udp_buffer_bytes: int = 4 << 20
    """Requested UDP socket send/receive buffer size (0 keeps the kernel default)."""
    session_tickets: bool = False
    """Issue single-use resumption tickets, which lets clients send 0-RTT early data."""
    steering: ConnectionIdSteering | None = None
    """This worker's place in a steered SO_REUSEPORT group (`tunnel.steering`): the
    connection IDs it issues lead back to it. None: IDs are fully random."""

    @property
    def read_batch_bytes(self) -> int:
        """What a request body read waits for: at most a quarter of the window, so the
        peer, which may send half a window ahead of the reads, always reaches it."""
        return min(READ_BATCH_BYTES, self.request_window_bytes // 4)


class TunnelProtocol(QuicConnectionProtocol):
    def __init__(
        self,
        *args: Any,
        handler: Handler,
        options: TunnelOptions,
        registry: ConnectionRegistry,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._handler = handler
        self._options = options
        self._registry = registry
        self._h3: TunnelH3Connection | None = None
        if options.steering is not None:
            steer_connection_ids(self._quic, options.steering)
        self._credit = ConsumptionCredit(
            self._quic, window_bytes=options.request_window_bytes, on_stalled=self._hand_over
        )
        visit_only_busy_streams(self._quic)
        delay_acknowledgements(self._quic)
        self.streams: dict[int, TunnelStream] = {}
        self._awaiting_drain: set[TunnelStream] = set()
        """Streams whose writer waits for acknowledgements: the only ones an ACK can wake."""
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._highest_request_stream_id: int | None = None
        self._goaway_sent = False
        self._handshake_done = False
        self._quiet_since = self._loop.time()
        """When a datagram last arrived or a keep-alive PING last left."""
        self._keepalive: asyncio.TimerHandle | None = None
        self.keepalive_pings_sent = 0
        limits = options.limits
        self._refused = limits.max_connections is not None and (
            len(registry.connections) >= limits.max_connections
        )
        """Over the connection limit: closed as soon as the first datagram set up keys."""
        if not self._refused:
            registry.opened(self)
        grant_peer_streams(self._quic, limits)
        if options.client_auth is not None:
            require_client_certificate(
                self._quic, options.client_auth, on_refused=options.on_connection_refused
            )

    # --- network side ---------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._quiet_since = self._loop.time()
        self._quic.receive_datagram(data, addr, now=self._quiet_since)  # type: ignore[arg-type]
        if self._refused and self._quic._close_event is None:
            refuse_connection(self._quic, "too many tunnel connections")
            self._options.on_connection_refused(CONNECTION_LIMIT)
        self._process_events()
        if self._awaiting_drain:
            self._awaiting_drain = {s for s in self._awaiting_drain if not s.wake_if_drained()}
        self._transmit_soon()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._h3 = BoundedH3Connection(self._quic)
            if self._registry.draining:
                self.send_goaway()
        elif isinstance(event, HandshakeCompleted):
            self._handshake_done = True
            self._schedule_keepalive()
            if self._options.client_auth is not None:
                logger.info("tunnel peer authenticated as %s", peer_identity(self._quic))
        elif isinstance(event, StreamReset | StopSendingReceived):
            self._abort_stream(event.stream_id, event.error_code)
        elif isinstance(event, ConnectionTerminated):
            self._stop_keepalive()
            for stream_id in list(self.streams):
                self._abort_stream(stream_id, event.error_code)
            self._registry.closed(self)
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._h3_event_received(h3_event)
            if isinstance(event, StreamDataReceived):
                self._refuse_oversized_head(self._h3, event.stream_id)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            if event.stream_id not in self.streams:
                self._start_stream(event.stream_id, event.headers, ended=event.stream_ended)
            elif event.stream_ended:  # trailers: nothing to forward, but the body is done
                self.streams[event.stream_id].feed(b"", end=True)
        elif isinstance(event, DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                self._credit.received(event.stream_id, len(event.data))
                stream.feed(event.data, end=event.stream_ended)
        elif isinstance(event, RequestMalformed):
            logger.info("malformed request on stream %d: %s", event.stream_id, event.reason)
            self._options.on_stream_refused(MALFORMED_REQUEST)
            self._abort_stream(event.stream_id, ErrorCode.H3_MESSAGE_ERROR)

    def _start_stream(
        self, stream_id: int, headers: Iterable[tuple[bytes, bytes]], *, ended: bool
    ) -> None:
        self._highest_request_stream_id = max(stream_id, self._highest_request_stream_id or 0)
        try:
            head = parse_request_head(headers)
        except MalformedRequest as exc:
            logger.info("malformed request on stream %d: %s", stream_id, exc)
            self._reject_malformed(stream_id, ended=ended)
            return
        stream = TunnelStream(
            stream_id=stream_id,
            head=head,
            owner=self,
            max_queued_bytes=self._options.max_queued_bytes_per_stream,
            read_batch_bytes=self._options.read_batch_bytes,
            over_limit=stream_over_limit(
                self._options.limits,
                on_connection=len(self.streams),
                in_total=self._registry.active_streams(),
            ),
            # Before the handshake completes, request data can only be 0-RTT.
            early=not self._handshake_done,
        )
        self._credit.track(stream_id)
        stream.feed(b"", end=ended)
        self.streams[stream_id] = stream
        task = self._loop.create_task(self._run_handler(stream))
        self._tasks[stream_id] = task

    def _hand_over(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.hand_over()

    def _refuse_oversized_head(self, h3: TunnelH3Connection, stream_id: int) -> None:
        """Reset a stream whose HEADERS frame is too large to buffer (see `tunnel.limits`)."""
        if not oversized_header_frame(h3, stream_id, self._options.limits.max_header_frame_bytes):
            return
        logger.info("header frame over the limit on stream %d", stream_id)
        self._abort_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)  # trailers on a served stream
        h3._fail_stream(stream_id, end_stream=h3._stream[stream_id].receiving_ended)
        self._options.on_stream_refused(HEADER_TOO_LARGE)
        self._transmit_soon()

    def _reject_malformed(self, stream_id: int, *, ended: bool) -> None:
        assert self._h3 is not None
        self._options.on_stream_refused(MALFORMED_REQUEST)
        if not ended:
            self._quic.stop_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
        self._quic.reset_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
        self._h3.forget_stream(stream_id)
        self._transmit_soon()

    async def _run_handler(self, stream: TunnelStream) -> None:
        try:
            await serve_stream(self._handler, stream)
        finally:
            self._finish_stream(stream)

    def _finish_stream(self, stream: TunnelStream) -> None:
        stream_id = stream.stream_id
        self.streams.pop(stream_id, None)
        self._tasks.pop(stream_id, None)
        self._awaiting_drain.discard(stream)
        self._credit.forget(stream_id)
        if not stream.received_all and not self._quic._close_pending:
            # RFC 9114 §4.1.1: the response is complete, the rest of the body is unwanted.
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        if self._h3 is not None:
            self._h3.forget_stream(stream_id)
        self._transmit_soon()

    def _abort_stream(self, stream_id: int, error_code: int) -> None:
        stream = self.streams.get(stream_id)
        task = self._tasks.get(stream_id)
        if stream is None or task is None:
            return
        stream.abort(error_code)
        task.cancel()

    def transmit(self) -> None:
        """aioquic's transmit, but with no packet built when there is nothing to send
        (`settled_without_packets`), and its timer re-armed only for an earlier deadline."""
        self._transmit_task = None
        transport = self._transport
        assert transport is not None  # the server hands it over before the first datagram
        quic, now = self._quic, self._loop.time()
        if not settled_without_packets(quic, now, self._credit.limit_to_write):
            for data, addr in quic.datagrams_to_send(now=now):
                transport.sendto(data, addr)
        deadline = quic.get_timer()
        if self._timer is not None and not timer_can_stay(self._timer_at, deadline):
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            # `_timer_at` stays the time the timer was armed for: aioquic's
            # `_handle_timer` takes it as the time, so it must never be later.
            self._timer_at = deadline
            if deadline is not None:
                self._timer = self._loop.call_at(deadline, self._handle_timer)

    # --- keep-alive -------------------------------------------------------------------

    def _schedule_keepalive(self) -> None:
        interval = self._options.ping_interval_s
        if interval:
            self._keepalive = self._loop.call_at(self._quiet_since + interval, self._keepalive_due)

    def _keepalive_due(self) -> None:
        """PING once the connection has been silent a whole interval (RFC 9000 §10.1.2).

        The peer's ACK refreshes NAT and firewall state and both idle timers;
        a dead peer sends none, so the idle timeout closes the connection.
        """
        interval = self._options.ping_interval_s
        assert interval
        now = self._loop.time()
        if now - self._quiet_since >= interval and not self._quic._close_pending:
            self._quic.send_ping(KEEPALIVE_PING_UID)
            self.keepalive_pings_sent += 1
            self._quiet_since = now
            self.transmit()
        self._schedule_keepalive()

    def _stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    def send_goaway(self) -> None:
        """RFC 9114 §5.2: tell the gateway to open no new request streams here.

        aioquic has no API for a server GOAWAY, so the frame is written on the
        local control stream directly. The id is the first stream not served.
        """
        if self._h3 is None or self._goaway_sent or self._quic._close_pending:
            return
        highest = self._highest_request_stream_id
        first_unserved = 0 if highest is None else highest + 4
        control_stream_id = self._h3._local_control_stream_id
        assert control_stream_id is not None
        frame = encode_frame(FrameType.GOAWAY, encode_uint_var(first_unserved))
        self._quic.send_stream_data(control_stream_id, frame)
        self._goaway_sent = True
        self._transmit_soon()

    # --- StreamOwner, used by TunnelStream --------------------------------------------

    def stream_send_headers(self, stream_id: int, headers: HeaderList, *, end: bool) -> None:
        assert self._h3 is not None
        self._h3.send_headers(stream_id, list(headers), end_stream=end)
        self._transmit_soon()

    def stream_send_data(self, stream_id: int, data: bytes, *, end: bool) -> None:
        assert self._h3 is not None
        self._h3.send_data(stream_id, data, end_stream=end)
        self._transmit_soon()

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        if not self._quic._close_pending:
            self._quic.reset_stream(stream_id, error_code)
        self._transmit_soon()

    def stream_queued_bytes(self, stream_id: int) -> int:
        return unacked_send_bytes(self._quic, stream_id)

    def stream_consumed(self, stream_id: int, byte_count: int) -> None:
        self._credit.consumed(stream_id, byte_count)
        self._transmit_soon()

    def stream_awaits_drain(self, stream: TunnelStream) -> None:
        self._awaiting_drain.add(stream)

    # --- introspection for gauges and leak tests ----------------------------------------

    def queued_bytes(self) -> int:
        return sum(unacked_send_bytes(self._quic, stream_id) for stream_id in self.streams)

    def tracked_state_count(self) -> int:
        """Request-stream objects held at every layer; 0 once the connection is idle.

        Control and QPACK streams live as long as the connection and are not counted.
        """
        h3_count = self._h3.tracked_stream_count if self._h3 is not None else 0
        quic_count = sum(
            1 for stream_id in self._quic._streams if stream_is_request_response(stream_id)
        )
        held = len(self.streams) + len(self._tasks) + len(self._awaiting_drain)
        return held + h3_count + quic_count
