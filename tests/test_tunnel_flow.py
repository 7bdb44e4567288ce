"""Consumption credit tells the reader when the peer is stuck waiting for it.

A `TunnelStream` reads request bodies in batches, so flow control must hand
the reader what is buffered when the peer can send no more until it reads.
Client and server QuicConnections exchange datagrams in memory
(`bench.sendpath.MemoryPair`), with `ConsumptionCredit` on the server.
"""

from __future__ import annotations

from pathlib import Path

from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StreamDataReceived

from bench.sendpath import MemoryPair, connect
from tunnel.flow import ConsumptionCredit

WINDOW = 64 * 1024
INITIAL_LIMIT = 1 << 20
"""The stream limit the server advertises in its transport parameters (aioquic's default)."""


class Server:
    """The server's credit and what it was told."""

    def __init__(self) -> None:
        self.credit: ConsumptionCredit | None = None
        self.stalled: list[int] = []
        self.received: dict[int, int] = {}

    def install(self, server: QuicConnection) -> None:
        self.credit = credit = ConsumptionCredit(
            server, window_bytes=WINDOW, on_stalled=self.stalled.append
        )
        next_event = server.next_event

        def delivering() -> QuicEvent | None:
            # What the tunnel does: each stream's data is buffered, unread, for its reader.
            event = next_event()
            if isinstance(event, StreamDataReceived):
                if event.stream_id not in self.received:
                    credit.track(event.stream_id)
                    self.received[event.stream_id] = 0
                self.received[event.stream_id] += len(event.data)
                credit.received(event.stream_id, len(event.data))
            return event

        server.next_event = delivering  # type: ignore[method-assign]


def start(tmp_path: Path) -> tuple[MemoryPair, Server]:
    setup = Server()
    return connect(tmp_path, server_hook=setup.install), setup


def test_a_peer_blocked_on_unread_data_is_reported_and_unblocked_by_a_read(
    tmp_path: Path,
) -> None:
    pair, server = start(tmp_path)
    assert server.credit is not None
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(stream_id, b"x" * (3 * INITIAL_LIMIT), end_stream=True)
    pair.tick(400)
    assert server.received[stream_id] == INITIAL_LIMIT  # nothing read: the peer is blocked
    assert stream_id in server.stalled

    server.credit.consumed(stream_id, server.received[stream_id])
    stalls = len(server.stalled)
    pair.tick(400)
    # The read granted about a window more (the pair counts data as read a tick late),
    # the peer used it and is blocked again.
    assert INITIAL_LIMIT + WINDOW <= server.received[stream_id] < INITIAL_LIMIT + 2 * WINDOW
    assert len(server.stalled) > stalls


def test_a_peer_with_credit_left_is_never_reported(tmp_path: Path) -> None:
    pair, server = start(tmp_path)
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(stream_id, b"x" * (INITIAL_LIMIT // 2), end_stream=False)
    pair.tick(400)
    assert server.received[stream_id] == INITIAL_LIMIT // 2
    assert server.stalled == []
