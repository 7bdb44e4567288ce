"""Flow control aioquic does not offer: credit by consumption, and send-queue depth.

aioquic raises a stream's receive window whenever the peer has used half of
it, however much the application has left unread, so a fast uploader can make
the endpoint buffer without bound. `ConsumptionCredit` replaces that rule for
request streams: the limit is the delivered stream offset, minus what the
handler has not read yet, plus `window_bytes`; it advances only as the handler
reads. Counting stream offsets (not payload bytes) keeps HTTP/3 frame headers
in the account, so the window cannot drift shut on a long stream. aioquic also
keeps every unacknowledged byte of a stream in its send buffer with no
backpressure; `unacked_send_bytes` reads that depth so the
writer can wait for the peer.

Both reach into aioquic internals (`QuicConnection._write_stream_limits`,
`QuicStreamSender._buffer`); they are kept to this module and pinned by tests
against the aioquic version the project locks.
"""

from __future__ import annotations

from collections.abc import Callable
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

    def __init__(
        self,
        quic: QuicConnection,
        *,
        window_bytes: int,
        on_stalled: Callable[[int], None] = lambda stream_id: None,
    ) -> None:
        self._quic = quic
        self._window_bytes = window_bytes
        self._on_stalled = on_stalled
        """Told a stream whose peer is blocked until the application reads more."""
        self._unread: dict[int, int] = {}
        self._default_write_stream_limits = quic._write_stream_limits
        quic._write_stream_limits = self._write_stream_limits  # type: ignore[method-assign]

    def track(self, stream_id: int) -> None:
        self._unread[stream_id] = 0

    def forget(self, stream_id: int) -> None:
        self._unread.pop(stream_id, None)

    def received(self, stream_id: int, byte_count: int) -> None:
        """Payload handed to the application's buffer, not yet read."""
        if stream_id in self._unread:
            self._unread[stream_id] += byte_count

    def consumed(self, stream_id: int, byte_count: int) -> None:
        """Payload the application has read."""
        if stream_id in self._unread:
            self._unread[stream_id] -= byte_count

    def limit_to_write(self, stream: Any) -> bool:
        """Whether `_write_stream_limits` would act on `stream` now: raise its limit, send
        a MAX_STREAM_DATA frame, or tell of a stall. Changes nothing (see `send_path`)."""
        if stream.receiver.is_finished:
            return False
        unread = self._unread.get(stream.stream_id)
        if unread is None or not stream.max_stream_data_local:
            local: int = stream.max_stream_data_local
            # aioquic's own rule: double once the peer has used half of the window.
            raised = bool(local) and stream.receiver.highest_offset * 2 > local
            return raised or bool(stream.max_stream_data_local_sent != local)
        target, stalled = self._credit_decision(stream, unread)
        return (
            target is not None
            or stalled
            or (stream.max_stream_data_local_sent != stream.max_stream_data_local)
        )

    def _credit_decision(self, stream: Any, unread: int) -> tuple[int | None, bool]:
        """The limit to raise a tracked stream to (None: keep it), and whether its peer
        waits for reads the application has not made."""
        # Raise the limit in half-window steps: one MAX_STREAM_DATA per small
        # read would flood the peer with ack-eliciting packets. But always raise
        # once the peer has reached the limit: aioquic holds back even the
        # retransmission of lost bytes on a blocked stream, so waiting for a
        # half-window of reads behind a gap would deadlock.
        target = stream.receiver.starting_offset() - unread + self._window_bytes
        peer_blocked = stream.receiver.highest_offset >= stream.max_stream_data_local
        step = target - stream.max_stream_data_local
        if step >= self._window_bytes // 2 or (peer_blocked and step > 0):
            return target, False
        # No credit until the application reads: an application that reads in
        # batches must take what it has (behind a gap, less than a batch).
        return None, peer_blocked and unread != 0

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: Any, stream: Any) -> None:
        # aioquic calls this for every stream on every packet it builds. Once the
        # peer's data is all in (FIN or reset), no credit is left to grant (RFC
        # 9000 §4.5): return before any work, which is most streams of an SSE load.
        if stream.receiver.is_finished:
            return
        unread = self._unread.get(stream.stream_id)
        if unread is None or not stream.max_stream_data_local:
            self._default_write_stream_limits(builder=builder, space=space, stream=stream)
            return
        target, stalled = self._credit_decision(stream, unread)
        if target is not None:
            stream.max_stream_data_local = target
        elif stalled:
            self._on_stalled(stream.stream_id)
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
