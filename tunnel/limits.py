"""Admission limits at the tunnel edge: connections, concurrent streams, header frames.

Strategy: the protocol asks these small functions whether a new connection or
stream is over a limit; what to answer is the application's business (a
stream over a concurrency limit is still handed to the handler, marked, so
the service can answer 503 in its own error shape). Two things only the
QUIC/HTTP3 layer can do live here too: granting the peer a bounded number of
concurrent streams (aioquic hard-codes 128 and offers no setting), and
refusing to buffer a HEADERS frame larger than the limit (aioquic buffers a
whole HEADERS frame before decoding it, and raises the stream window of a
request not yet handed to the application as data arrives, so without this a
peer could make it buffer without bound). And the decoded size of a frame is
bounded too: `BoundedH3Connection` offers no QPACK dynamic table, because one
byte of a field section can name a dynamic entry of up to 4 KiB (aioquic's
capacity), so a 128 KiB frame decodes to 512 MiB in one synchronous call;
with the static table only, a byte names at most a few dozen bytes. Nor does
it use the gateway's dynamic table for responses, since each reference costs
an acknowledgement packet each way. These reach into aioquic internals
(`QuicConnection._local_max_streams_bidi`, `H3Connection._stream`,
`_init_connection`, `_encoder`), pinned by tests against the aioquic version
the project locks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pylsqpack
from aioquic.h3.connection import FrameType, H3Connection, stream_is_request_response
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicFrameType

from tunnel.h3 import TunnelH3Connection
from tunnel.stream import StreamLimit

__all__ = [
    "STREAM_CREDIT_HEADROOM",
    "BoundedH3Connection",
    "StaticTableEncoder",
    "TunnelLimits",
    "grant_peer_streams",
    "oversized_header_frame",
    "refuse_connection",
    "stream_over_limit",
]

STREAM_CREDIT_HEADROOM = 16
"""Request streams the peer may open beyond the per-connection limit. Those get
a fast 503 (retry-safe) the gateway can act on at once, instead of waiting
unseen in its own QUIC stack for stream credit; beyond the headroom, QUIC
flow control stops the peer, so a misbehaving peer still holds bounded state."""


@dataclass(frozen=True)
class TunnelLimits:
    max_connections: int | None = None
    """Open connections; one more is closed with CONNECTION_REFUSED."""
    max_streams_per_connection: int | None = None
    """Request streams served at once on one connection (None: aioquic's 128 credit)."""
    max_streams_total: int | None = None
    """Request streams served at once over all connections."""
    max_header_frame_bytes: int | None = None
    """Encoded HEADERS frame size beyond which a stream is reset without decoding."""


class BoundedH3Connection(TunnelH3Connection):
    """The tunnel's HTTP/3 connection, with no QPACK dynamic table either way.

    Decoding: set before SETTINGS go out, so the peer's encoder never
    references one (RFC 9204 §3.2.3: capacity 0), and decoding is linear in
    the frame. Encoding: responses use the static table even when the peer
    offers a dynamic one. A field section that references the dynamic table
    makes the peer's decoder send a Section Acknowledgment (§4.4.1), one more
    ack-eliciting packet per response that Pylon must acknowledge in turn:
    about two of the six datagrams of a small request, for a few bytes of
    compression.
    """

    def _init_connection(self) -> None:
        self._max_table_capacity = 0
        self._blocked_streams = 0
        self._decoder = pylsqpack.Decoder(self._max_table_capacity, self._blocked_streams)
        self._encoder = StaticTableEncoder()  # type: ignore[assignment]
        super()._init_connection()


class StaticTableEncoder:
    """pylsqpack's encoder held to the static table, whatever capacity the peer offers.

    pylsqpack's `Encoder` cannot be subclassed; its methods are bound here as
    attributes, so encoding costs no extra call.
    """

    def __init__(self) -> None:
        encoder = pylsqpack.Encoder()
        self._apply_settings = encoder.apply_settings
        self.encode = encoder.encode
        self.feed_decoder = encoder.feed_decoder

    def apply_settings(self, max_table_capacity: int, blocked_streams: int) -> bytes:
        return self._apply_settings(max_table_capacity=0, blocked_streams=0)


def grant_peer_streams(quic: QuicConnection, limits: TunnelLimits) -> None:
    """Set the concurrent request streams the peer may open; before the first datagram.

    The value goes out in the transport parameters, and aioquic raises it by one
    for each stream that ends, so it stays a concurrency bound.
    """
    if limits.max_streams_per_connection is None:
        return
    credit = limits.max_streams_per_connection + STREAM_CREDIT_HEADROOM
    quic._local_max_streams_bidi.value = credit
    quic._local_max_streams_bidi.sent = credit


def stream_over_limit(
    limits: TunnelLimits, *, on_connection: int, in_total: int
) -> StreamLimit | None:
    """Which limit a new stream is over, given the streams already being served."""
    per_connection = limits.max_streams_per_connection
    if per_connection is not None and on_connection >= per_connection:
        return StreamLimit.PER_CONNECTION
    if limits.max_streams_total is not None and in_total >= limits.max_streams_total:
        return StreamLimit.TOTAL
    return None


def oversized_header_frame(h3: H3Connection, stream_id: int, limit: int | None) -> bool:
    """Whether a request stream is buffering a HEADERS frame declared larger than `limit`."""
    if limit is None or not stream_is_request_response(stream_id):
        return False
    stream = h3._stream.get(stream_id)
    if stream is None or stream.frame_type != FrameType.HEADERS:
        return False
    return stream.frame_size is not None and stream.frame_size > limit


def refuse_connection(quic: QuicConnection, reason: str) -> None:
    """Close with CONNECTION_REFUSED (RFC 9000 §20.1), a transport-level close."""
    quic.close(
        error_code=QuicErrorCode.CONNECTION_REFUSED,
        frame_type=QuicFrameType.PADDING,
        reason_phrase=reason,
    )
