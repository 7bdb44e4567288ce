"""When a tunnel connection acknowledges the gateway's packets: RFC 9000 §13.2.

aioquic acknowledges every ack-eliciting 1-RTT packet 1 ms after it arrives
(`K_GRANULARITY`), and puts a pending ACK only in packets built after that
time. A request answered 1.5 ms later therefore costs an ACK-only datagram
from Pylon before the response, and the gateway a datagram to read.

`delay_acknowledgements` changes when the application packet space
acknowledges, within what RFC 9000 §13.2 allows:

- the first ack-eliciting packet since the last ACK, arriving in order, is
  acknowledged within `ACK_DELAY_S`, below the 25 ms `max_ack_delay` aioquic
  advertises, so the gateway's loss timers already allow for it (§13.2.1);
- a second ack-eliciting packet is acknowledged within 1 ms, together with
  every packet that follows it in that time: aioquic's own timing, which
  sends one ACK a millisecond for a request body where acknowledging every
  second packet (§13.2.2's suggestion, quic-go's choice) would send dozens;
- a packet out of order (one past a gap, or a late one) is acknowledged at
  once, which helps the gateway detect loss (§13.2.1);
- any packet that carries stream data carries the pending ACK with it.

Only ack-eliciting packets count: the gateway's ACK of one response,
arriving after its next request, leaves that request's ACK to ride on its
own response (§13.2.1 asks for an immediate ACK only for ack-eliciting
packets). Initial and Handshake packets keep aioquic's timing; the
handshake is not slowed. This reaches into aioquic internals
(`receive_datagram`, `_write_application`, `_spaces`); it is kept to this
module and pinned by tests against the aioquic version the project locks.
"""

from __future__ import annotations

from typing import Any

from aioquic import tls
from aioquic.quic.congestion.base import K_GRANULARITY
from aioquic.quic.connection import QuicConnection

ACK_DELAY_S = 0.020
"""How long a lone in-order packet may wait for its ACK to ride on a response."""

_ONE_RTT = tls.Epoch.ONE_RTT


def delay_acknowledgements(quic: QuicConnection, *, delay_s: float = ACK_DELAY_S) -> None:
    """Hook `quic` so that its 1-RTT acknowledgements ride on responses (see the module)."""
    receive_datagram = quic.receive_datagram
    write_application = quic._write_application
    spaces = quic._spaces

    def receive_and_schedule_ack(data: bytes, addr: Any, now: float) -> None:
        # Runs for every datagram (an upload is some 900 of them), so it stays lean.
        nonlocal spaces
        space = spaces.get(_ONE_RTT)
        if space is None:  # before the first datagram sets up the packet spaces
            receive_datagram(data, addr, now)
            spaces = quic._spaces
            return
        pending = space.ack_at
        largest = space.largest_received_packet
        # aioquic sets `ack_at` only for an ack-eliciting packet and only when it
        # is unset, so clearing it first tells such a packet from one that needs
        # no ACK (the gateway's ACK of a response), which leaves `pending` alone.
        space.ack_at = None
        try:
            receive_datagram(data, addr, now)
        finally:
            asks_for_ack = space.ack_at is not None
            if not asks_for_ack:
                space.ack_at = pending
        if not asks_for_ack:
            return
        # A datagram holds at most one 1-RTT packet: its short header runs to the end.
        step = space.largest_received_packet - largest
        if step != 1:  # past a gap, or late
            space.ack_at = now
        elif pending is None:  # the first packet since the last ACK, in order
            space.ack_at = now + delay_s
        else:  # another packet while one waits: aioquic's own pace
            space.ack_at = min(pending, now + K_GRANULARITY)

    def write_application_with_ack(builder: Any, network_path: Any, now: float) -> None:
        space = quic._spaces[_ONE_RTT]
        if space.ack_at is not None and space.ack_at > now:
            for stream in quic._streams_queue:  # a loop, not any(): it runs every transmit
                if not stream.sender.buffer_is_empty:
                    space.ack_at = now  # the first packet with stream data carries it
                    break
        write_application(builder, network_path, now)

    quic.receive_datagram = receive_and_schedule_ack  # type: ignore[method-assign]
    quic._write_application = write_application_with_ack  # type: ignore[method-assign]
