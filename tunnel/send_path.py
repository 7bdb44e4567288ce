"""aioquic's packet builder, made to visit only the streams that have something to send.

aioquic builds each packet by walking every stream of the connection twice:
once to offer each a MAX_STREAM_DATA frame, once to ask each for a STREAM
frame, even after the packet has no room left. With many concurrent SSE
streams most of those visits find nothing to do: a stream waits 20 ms
between tokens, and a full packet has no room for its frame anyway (at 256
streams under load, 94 % of the asks for a STREAM frame came back empty).

`visit_only_busy_streams` changes who is visited, not what is sent:

- once per transmit, not per packet, it sets aside the streams with nothing
  to send, reset, stop or drop, and those whose receiving side has ended (no
  credit left to raise), and lets aioquic's own loop walk the rest;
- it ends a packet's walk once fewer bytes are left than the smallest STREAM
  frame header, so no stream could add a frame, and starts the next packet,
  as aioquic's loop does after a full walk;
- afterwards it puts the set-aside streams back where aioquic's loop would
  have left them: ahead of every stream that sent, in their old order.

The frames each packet carries and their order stay the same. Two things
can move to a later packet: dropping the state of a stream that has finished,
and a STOP_SENDING or RESET_STREAM frame for a stream behind a full packet
(aioquic would otherwise give up the whole transmit when it does not fit).

`settled_without_packets` spares a transmit the packet builder when it would
build nothing. A small request wakes the connection some three times with nothing
to send (its own datagram, whose ACK waits to ride on the response; the
gateway's ACK of the response; the read of the body), and each such attempt
costs aioquic a packet started and thrown away, and often a pacing timer for
nothing. The check reads the same state `_write_application` reads, in the
same terms, and answers True only when every frame it could write is absent.

This reaches into aioquic internals (`QuicConnection._write_application`,
`_write_stream_frame`, `_streams`, `_streams_queue`, the pending-frame flags);
it is kept to this module and pinned by tests against the aioquic version the
project locks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aioquic import tls
from aioquic.quic.connection import (
    QuicConnection,
    QuicConnectionState,
    stream_is_client_initiated,
)
from aioquic.quic.packet_builder import QuicPacketBuilder, QuicPacketBuilderStop
from aioquic.quic.stream import QuicStream

SMALLEST_STREAM_FRAME_HEADER = 4
"""Frame type, a 1-byte stream id and a 2-byte length: aioquic's least frame overhead."""


_CONNECTED = QuicConnectionState.CONNECTED
_ONE_RTT = tls.Epoch.ONE_RTT

IDLE_CHECK_MAX_STREAMS = 32
"""Above this many streams the check would cost about what it saves, and a transmit
with nothing to send is rare (there is nearly always a stream with data)."""


def settled_without_packets(
    quic: QuicConnection, now: float, limit_to_write: Callable[[QuicStream], bool]
) -> bool:
    """Do what `quic.datagrams_to_send(now)` would do when it has no packet to build,
    and say so; False (and nothing changed) when it may have one.

    No packet means: an established connection on one validated path, no ACK
    due, no pending control frame, no stream with a frame to send, no receive
    limit to raise (`limit_to_write`, the credit hook's own rule), and no MAX_*
    frame due once the streams that have finished both ways are dropped. The
    drop is aioquic's own first step of building (`_write_application`): each
    such stream leaves the connection and, if the peer opened it, lets the peer
    open another. Pacing needs no timer when there is nothing to pace.
    """
    if (
        quic._state is not _CONNECTED
        or quic._close_pending
        or not quic._handshake_confirmed
        or quic._probe_pending
        or quic._ping_pending
        or quic._datagrams_pending
        or quic._handshake_done_pending
        or quic._streams_blocked_pending
        or quic._retire_connection_ids
        or len(quic._network_paths) != 1
        or len(quic._streams) > IDLE_CHECK_MAX_STREAMS
    ):
        return False
    path = quic._network_paths[0]
    if not path.is_validated or path.remote_challenges:
        return False
    ack_at = quic._spaces[_ONE_RTT].ack_at
    if ack_at is not None and ack_at <= now:
        return False
    crypto_stream = quic._crypto_streams.get(_ONE_RTT)
    if crypto_stream is not None and not crypto_stream.sender.buffer_is_empty:
        return False
    for connection_id in quic._host_cids:
        if not connection_id.was_sent:
            return False
    finished = []
    # The test `write_application_packets` uses for its active streams, split so the
    # finished ones can be dropped here; written out in both because each walks every
    # stream on the hot path.
    for stream in quic._streams_queue:
        sender, receiver = stream.sender, stream.receiver
        if not sender.buffer_is_empty or sender.reset_pending or receiver.stop_pending:
            return False
        if sender.is_finished and receiver.is_finished:
            finished.append(stream)
    for stream in quic._streams.values():
        if limit_to_write(stream):
            return False
    if finished:
        _drop_finished(quic, finished)
    if _connection_limit_to_write(quic):
        return False
    quic._pacing_at = None
    return True


def _drop_finished(quic: QuicConnection, finished: list[QuicStream]) -> None:
    """aioquic's discard of streams finished both ways, in `_write_application`."""
    for stream in finished:
        stream_id = stream.stream_id
        assert stream_id is not None  # every stream of a connection has its id
        quic._streams.pop(stream_id, None)
        if stream_is_client_initiated(stream_id) != quic._is_client:
            quic._stream_limit(stream_id).value += 1
    dropped = set(finished)
    quic._streams_queue = [stream for stream in quic._streams_queue if stream not in dropped]


def _connection_limit_to_write(quic: QuicConnection) -> bool:
    """Whether `_write_connection_limits` would raise MAX_DATA or send a MAX_* frame."""
    max_data = quic._local_max_data
    if max_data.used * 2 > max_data.value or max_data.value != max_data.sent:
        return True
    return any(
        limit.value != limit.sent and limit.sent - limit.used < limit.value - limit.sent
        for limit in (quic._local_max_streams_bidi, quic._local_max_streams_uni)
    )


class _PacketFull(Exception):
    """The packet being built has no room for another STREAM frame."""


def visit_only_busy_streams(quic: QuicConnection) -> None:
    """Hook `quic` so that building packets visits only streams with something to do."""
    write_stream_frame = quic._write_stream_frame
    write_application = quic._write_application
    sent: set[QuicStream] = set()

    def write_stream_frame_if_room(
        builder: QuicPacketBuilder, space: Any, stream: Any, max_offset: int
    ) -> int:
        if builder.remaining_flight_space < SMALLEST_STREAM_FRAME_HEADER:
            # An empty packet with no room means the congestion window is spent:
            # aioquic would end this transmit after the walk, so end it now.
            raise QuicPacketBuilderStop if builder.packet_is_empty else _PacketFull
        used: int = write_stream_frame(
            builder=builder, space=space, stream=stream, max_offset=max_offset
        )
        if used > 0:  # aioquic moves such a stream to the back of its queue
            sent.add(stream)
        return used

    def write_application_packets(
        builder: QuicPacketBuilder, network_path: Any, now: float
    ) -> None:
        streams, queue = quic._streams, quic._streams_queue
        # Credit: Pylon's hook (flow.py) grants none once the receiving side has
        # ended; a stream that has finished both ways stays, for aioquic to drop.
        quic._streams = {
            stream_id: stream
            for stream_id, stream in streams.items()
            if not stream.receiver.is_finished or stream.sender.is_finished
        }
        # Frames: aioquic acts on data or a FIN, a reset, a stop, or a drop.
        active = [
            stream
            for stream in queue
            if not stream.sender.buffer_is_empty
            or stream.sender.reset_pending
            or stream.receiver.stop_pending
            or (stream.sender.is_finished and stream.receiver.is_finished)
        ]
        quic._streams_queue = active
        sent.clear()
        try:
            while True:
                try:
                    write_application(builder, network_path, now)
                    return
                except _PacketFull:
                    # What aioquic's loop does after a packet with something in it.
                    quic._loss._pacer.update_after_send(now=now)
        finally:
            walked = quic._streams_queue
            quic._streams, quic._streams_queue = streams, queue
            if sent or len(walked) != len(active):
                remaining = set(walked)
                dropped = {stream for stream in active if stream not in remaining}
                for stream in dropped:
                    if stream.stream_id is not None:
                        streams.pop(stream.stream_id, None)
                # aioquic's order: the streams that never sent, as they were, then
                # the ones that did, in the order its loop left them.
                quic._streams_queue = [
                    stream for stream in queue if stream not in sent and stream not in dropped
                ] + [stream for stream in walked if stream in sent]

    quic._write_stream_frame = write_stream_frame_if_room  # type: ignore[method-assign]
    quic._write_application = write_application_packets  # type: ignore[method-assign]
