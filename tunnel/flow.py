"""Flow control aioquic does not offer: credit by consumption, and send-queue depth.

aioquic raises a stream's receive window whenever the peer has used half of
it, however much the application has left unread, so a fast uploader can make
the endpoint buffer without bound. `ConsumptionCredit` replaces that rule for
request streams: the window is `consumed + window_bytes`, advanced only as the
handler reads. aioquic also keeps every unacknowledged byte of a stream in its
send buffer with no backpressure; `unacked_send_bytes` reads that depth so the
writer can wait for the peer.

Both reach into aioquic internals (`QuicConnection._write_stream_limits`,
`QuicStreamSender._buffer`); they are kept to this module and pinned by tests
against the aioquic version the project locks.
"""

from __future__ import annotations

from typing import Any

from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder

_MAX_STREAM_DATA_FRAME_CAPACITY = 1 + 8 + 8
"""Frame type, stream id and limit, each a varint of at most 8 bytes."""


def unacked_send_bytes(quic: QuicConnection, stream_id: int) -> int:
    """Bytes queued on a stream that the peer has not acknowledged yet."""
    stream = quic._streams.get(stream_id)
    if stream is None:
        return 0
    return len(stream.sender._buffer)


class ConsumptionCredit:
    """Grants receive credit on tracked streams only as the application consumes data."""

    def __init__(self, quic: QuicConnection, *, window_bytes: int) -> None:
        self._quic = quic
        self._window_bytes = window_bytes
        self._consumed: dict[int, int] = {}
        self._default_write_stream_limits = quic._write_stream_limits
        quic._write_stream_limits = self._write_stream_limits  # type: ignore[method-assign]

    def track(self, stream_id: int) -> None:
        self._consumed[stream_id] = 0

    def forget(self, stream_id: int) -> None:
        self._consumed.pop(stream_id, None)

    def consumed(self, stream_id: int, byte_count: int) -> None:
        if stream_id in self._consumed:
            self._consumed[stream_id] += byte_count

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: Any, stream: Any) -> None:
        consumed = self._consumed.get(stream.stream_id)
        if consumed is None or not stream.max_stream_data_local:
            self._default_write_stream_limits(builder=builder, space=space, stream=stream)
            return
        stream.max_stream_data_local = max(
            stream.max_stream_data_local, consumed + self._window_bytes
        )
        if stream.max_stream_data_local_sent == stream.max_stream_data_local:
            return
        buf = builder.start_frame(
            QuicFrameType.MAX_STREAM_DATA,
            capacity=_MAX_STREAM_DATA_FRAME_CAPACITY,
            handler=self._quic._on_max_stream_data_delivery,
            handler_args=(stream,),
        )
        buf.push_uint_var(stream.stream_id)
        buf.push_uint_var(stream.max_stream_data_local)
        stream.max_stream_data_local_sent = stream.max_stream_data_local
