"""The send-path hook changes which streams aioquic visits, not what it sends.

Client and server QuicConnections exchange datagrams in memory on a clock the
test advances (`bench.sendpath.MemoryPair`), so the same scenario builds the
same packets twice: once with the hook on the server, once without.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamDataReceived, StreamReset
from aioquic.quic.logger import QuicLogger
from aioquic.quic.stream import QuicStream
from hypothesis import given
from hypothesis import strategies as st

from bench.sendpath import MemoryPair, connect, open_streams, run_sendpath
from tunnel.flow import ConsumptionCredit
from tunnel.send_path import visit_only_busy_streams
from tunnel.server import timer_can_stay

STREAMS = 48
ROUNDS = 6

StreamFrame = tuple[int, int, int, bool]
"""stream id, offset, length, fin"""


class Server:
    """How the server was set up, and what it did."""

    def __init__(self, *, hooked: bool) -> None:
        self.hooked = hooked
        self.log = QuicLogger()
        self.frame_asks = 0
        """Calls into aioquic's own STREAM-frame writer."""

    def install(self, server: QuicConnection) -> None:
        ConsumptionCredit(server, window_bytes=1 << 20)  # as on every tunnel connection
        write_stream_frame = server._write_stream_frame

        def counted(**kwargs: Any) -> int:
            self.frame_asks += 1
            return write_stream_frame(**kwargs)

        server._write_stream_frame = counted  # type: ignore[method-assign,assignment]
        if self.hooked:
            visit_only_busy_streams(server)

    def stream_frames_by_packet(self) -> list[list[StreamFrame]]:
        (trace,) = self.log.to_dict()["traces"]
        packets = []
        for event in trace["events"]:
            if event["name"] != "transport:packet_sent":
                continue
            frames = [
                (f["stream_id"], f["offset"], f["length"], f["fin"])
                for f in event["data"]["frames"]
                if f["frame_type"] == "stream"
            ]
            if frames:
                packets.append(frames)
        return packets


def start(tmp_path: Path, *, hooked: bool) -> tuple[MemoryPair, Server]:
    setup = Server(hooked=hooked)
    pair = connect(tmp_path, server_hook=setup.install, server_log=setup.log)
    pair.client_events = []
    return pair, setup


def received_bytes(pair: MemoryPair) -> dict[int, int]:
    received: dict[int, int] = {}
    for event in pair.client_events or ():
        if isinstance(event, StreamDataReceived):
            received[event.stream_id] = received.get(event.stream_id, 0) + len(event.data)
    return received


def respond(tmp_path: Path, *, hooked: bool) -> tuple[MemoryPair, Server, dict[int, int]]:
    """Every stream answers in rounds of 1 to 3,000 bytes, more than a packet or a window holds;
    some streams skip rounds, so idle streams sit between busy ones."""
    pair, setup = start(tmp_path, hooked=hooked)
    stream_ids = open_streams(pair, STREAMS)
    sizes = random.Random(7)
    sent = dict.fromkeys(stream_ids, 0)
    for round_index in range(ROUNDS):
        last = round_index == ROUNDS - 1
        for stream_id in stream_ids:
            if not last and sizes.random() < 0.3:
                continue
            size = sizes.choice((sizes.randrange(1, 200), sizes.randrange(200, 3000)))
            pair.server.send_stream_data(stream_id, bytes(size), end_stream=last)
            sent[stream_id] += size
        pair.tick(5)
    pair.tick(400)
    return pair, setup, sent


def test_the_hook_sends_the_same_stream_frames_in_the_same_packets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aioquic requeues the streams a packet served from a set, in hash order;
    # hashing by stream id instead of address makes that order repeatable.
    monkeypatch.setattr(QuicStream, "__hash__", lambda stream: stream.stream_id)
    _, plain, plain_sent = respond(tmp_path, hooked=False)
    pair, hooked, hooked_sent = respond(tmp_path, hooked=True)

    assert plain_sent == hooked_sent
    assert received_bytes(pair) == hooked_sent
    ended = {
        e.stream_id
        for e in pair.client_events or ()
        if isinstance(e, StreamDataReceived) and e.end_stream
    }
    assert ended == set(hooked_sent)
    frames = hooked.stream_frames_by_packet()
    assert sum(len(packet) for packet in frames) > STREAMS * ROUNDS / 2
    assert frames == plain.stream_frames_by_packet()


def test_the_hook_stops_asking_streams_once_the_packet_is_full(tmp_path: Path) -> None:
    _, plain, _ = respond(tmp_path, hooked=False)
    _, hooked, _ = respond(tmp_path, hooked=True)

    assert hooked.frame_asks < plain.frame_asks / 2


def test_finished_streams_are_still_dropped(tmp_path: Path) -> None:
    pair, _, _ = respond(tmp_path, hooked=True)

    assert pair.server._streams == {}
    assert pair.server._streams_queue == []


@pytest.mark.parametrize("hooked", [False, True])
def test_a_reset_behind_a_full_packet_still_reaches_the_peer(tmp_path: Path, hooked: bool) -> None:
    pair, _ = start(tmp_path, hooked=hooked)
    stream_ids = open_streams(pair, STREAMS)
    for stream_id in stream_ids:
        pair.server.send_stream_data(stream_id, bytes(2000))
    doomed = stream_ids[1::3]
    for stream_id in doomed:
        pair.server.reset_stream(stream_id, error_code=0x10C)
    pair.tick(400)

    reset = {e.stream_id for e in pair.client_events or () if isinstance(e, StreamReset)}
    assert reset == set(doomed)
    received = received_bytes(pair)
    for stream_id in set(stream_ids) - set(doomed):
        assert received[stream_id] == 2000


def test_sendpath_bench_smoke() -> None:
    runs = run_sendpath(streams=32, tokens_per_s=50.0, duration_s=0.1, rounds=1)

    assert sorted(run.hooked for run in runs) == [False, True]
    assert all(run.events > 0 and run.server_cpu_s > 0 for run in runs)


times = st.one_of(st.none(), st.floats(min_value=0, max_value=1e6, allow_nan=False))


@given(armed_at=times, deadline=times)
def test_a_timer_stays_only_if_it_fires_no_later_than_the_deadline(
    armed_at: float | None, deadline: float | None
) -> None:
    stays = timer_can_stay(armed_at, deadline)
    if armed_at is None or deadline is None:
        assert not stays  # no timer to keep, or none wanted
    else:
        assert stays == (armed_at <= deadline)
