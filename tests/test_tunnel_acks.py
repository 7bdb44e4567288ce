"""A tunnel connection acknowledges within what RFC 9000 §13.2 allows (`tunnel.acks`).

Client and server QuicConnections exchange datagrams in memory on a clock the
test moves (`bench.sendpath.MemoryPair`); the server's qlog, stamped with that
clock, shows which packets carried which frames and when.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic import logger as quic_logger_module
from aioquic.quic.connection import QuicConnection
from aioquic.quic.logger import QuicLogger
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.experiments.ack_upload import report, run_uploads
from bench.sendpath import CLIENT_ADDR, SERVER_ADDR, MemoryPair, connect
from tunnel.acks import ACK_DELAY_S, delay_acknowledgements

MS = 0.001
NOT_ACK_ELICITING = {"ack", "padding", "connection_close"}


class Clock:
    now = 0.0


@pytest.fixture(autouse=True)
def qlog_on_the_test_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    monkeypatch.setattr(quic_logger_module, "time", types.SimpleNamespace(time=lambda: clock.now))
    yield clock


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("certs")


class Link:
    """One connected pair; the test decides which client datagrams reach the server."""

    def __init__(self, cert_dir: Path, clock: Clock, *, hooked: bool = True) -> None:
        self.log = QuicLogger()
        self.clock = clock
        hook = delay_acknowledgements if hooked else None
        self.pair: MemoryPair = connect(cert_dir, server_hook=hook, server_log=self.log)
        self.pair.tick(50)  # the handshake's last ACKs, so each test starts quiet
        self.seen = len(self.events())
        self.advance(0)

    @property
    def client(self) -> QuicConnection:
        return self.pair.client

    @property
    def server(self) -> QuicConnection:
        return self.pair.server

    @property
    def now(self) -> float:
        return self.pair.now

    def advance(self, seconds: float) -> None:
        self.pair.now += seconds
        self.clock.now = self.pair.now

    def events(self) -> list[dict[str, Any]]:
        (trace,) = self.log.to_dict()["traces"]
        return list(trace["events"])

    def client_datagrams(self) -> list[bytes]:
        return [data for data, _ in self.client.datagrams_to_send(now=self.now)]

    def request(self) -> list[bytes]:
        """The datagrams of one small request (one ack-eliciting packet)."""
        stream_id = self.client.get_next_available_stream_id()
        self.client.send_stream_data(stream_id, b"request", end_stream=True)
        return self.client_datagrams()

    def deliver(self, datagrams: list[bytes]) -> None:
        for data in datagrams:
            self.server.receive_datagram(data, CLIENT_ADDR, now=self.now)

    def server_packets(self) -> list[set[str]]:
        """Frame types (padding aside) of each packet the server sends now, to the client."""
        timer = self.server.get_timer()
        if timer is not None and timer <= self.now:
            self.server.handle_timer(now=self.now)
        for data, _ in self.server.datagrams_to_send(now=self.now):
            self.client.receive_datagram(data, SERVER_ADDR, now=self.now)
        events = self.events()
        new, self.seen = events[self.seen :], len(events)
        return [
            {frame["frame_type"] for frame in event["data"]["frames"]} - {"padding"}
            for event in new
            if event["name"] == "transport:packet_sent"
        ]


@pytest.fixture
def link(cert_dir: Path, qlog_on_the_test_clock: Clock) -> Link:
    """A connected pair with the hook on the server."""
    return Link(cert_dir, qlog_on_the_test_clock)


def test_a_lone_request_is_acknowledged_by_its_response(link: Link) -> None:
    link.deliver(request := link.request())
    assert len(request) == 1
    link.advance(3 * MS)
    assert link.server_packets() == []  # no ACK-only datagram while the engine answers

    link.server.send_stream_data(0, b"response", end_stream=True)
    assert link.server_packets() == [{"ack", "stream"}]


def test_aioquic_alone_would_send_an_ack_of_its_own(
    cert_dir: Path, qlog_on_the_test_clock: Clock
) -> None:
    """What the hook replaces: an ACK-only datagram 1 ms after the request."""
    link = Link(cert_dir, qlog_on_the_test_clock, hooked=False)
    link.deliver(link.request())
    link.advance(3 * MS)
    assert link.server_packets() == [{"ack"}]


def test_a_lone_packet_is_acknowledged_within_the_delay(link: Link) -> None:
    arrived = link.now
    link.deliver(link.request())
    timer = link.server.get_timer()
    assert timer is not None and arrived + 3 * MS < timer <= arrived + ACK_DELAY_S

    link.advance(timer - link.now - MS / 10)
    assert link.server_packets() == []
    link.advance(MS / 10)
    assert link.server_packets() == [{"ack"}]


def test_a_second_packet_is_acknowledged_within_a_millisecond(link: Link) -> None:
    link.deliver(link.request())
    link.advance(5 * MS)
    assert link.server_packets() == []
    link.deliver(link.request())
    link.advance(MS - MS / 10)
    assert link.server_packets() == []
    link.advance(MS / 10)
    assert link.server_packets() == [{"ack"}]


def test_a_burst_gets_one_ack_a_millisecond(link: Link) -> None:
    """A request body's packets, read one loop pass each: aioquic's ACK rate, not one per two."""
    acks = 0
    for _ in range(30):
        link.deliver(link.request())
        acks += sum("ack" in frames for frames in link.server_packets())
        link.advance(MS / 5)
    assert 4 <= acks <= 7


def test_a_packet_past_a_gap_is_acknowledged_at_once(link: Link) -> None:
    link.request()  # lost on the way
    link.advance(MS)
    link.deliver(link.request())
    assert link.server_packets() == [{"ack"}]


def test_a_late_packet_is_acknowledged_at_once(link: Link) -> None:
    early, late = link.request(), link.request()
    link.deliver(late)
    assert link.server_packets() == [{"ack"}]  # past a gap
    link.advance(MS)
    link.deliver(early)
    assert link.server_packets() == [{"ack"}]


def test_a_packet_that_needs_no_ack_asks_for_none(link: Link) -> None:
    link.server.send_ping(1)  # ack-eliciting: the client answers with an ACK-only packet
    assert link.server_packets() == [{"ping"}]
    link.advance(2 * MS)
    (ack_only,) = link.client_datagrams()
    link.deliver([ack_only])
    assert link.server.get_timer() is None or link.server.get_timer() > link.now + 0.1
    link.advance(ACK_DELAY_S + MS)
    assert link.server_packets() == []


def test_an_ack_only_packet_leaves_a_waiting_ack_alone(link: Link) -> None:
    """One at a time: the gateway sends its next request before its ACK of the last response."""
    link.server.send_stream_data(1, b"response", end_stream=True)
    assert link.server_packets() == [{"stream"}]  # the client now owes an ACK, due in 1 ms
    arrived = link.now
    link.deliver(request := link.request())
    assert len(request) == 1
    link.advance(2 * MS)
    (ack_only,) = link.client_datagrams()
    link.deliver([ack_only])
    timer = link.server.get_timer()
    assert timer is not None and timer > arrived + 3 * MS  # the request's ACK still waits

    link.advance(3 * MS)
    assert link.server_packets() == []  # no ACK-only datagram while the engine answers
    link.server.send_stream_data(0, b"response", end_stream=True)
    assert link.server_packets() == [{"ack", "stream"}]


def test_an_ack_only_packet_past_a_gap_is_not_acknowledged_at_once(link: Link) -> None:
    """§13.2.1's immediate ACK is for ack-eliciting packets; the waiting one keeps its time."""
    link.server.send_ping(1)
    assert link.server_packets() == [{"ping"}]
    arrived = link.now
    link.deliver(link.request())
    link.request()  # lost on the way
    link.advance(2 * MS)
    (ack_only,) = link.client_datagrams()
    link.deliver([ack_only])
    assert link.server_packets() == []
    timer = link.server.get_timer()
    assert timer is not None and timer > arrived + 3 * MS


def test_the_advertised_max_ack_delay_covers_the_delay(link: Link) -> None:
    # What the gateway's loss timers allow for, from the server's transport parameters.
    assert link.client._loss.max_ack_delay >= ACK_DELAY_S + 4 * MS


def test_the_handshake_is_acknowledged_as_before(
    cert_dir: Path, qlog_on_the_test_clock: Clock
) -> None:
    def handshake_packets(hooked: bool) -> list[tuple[str, list[str]]]:
        events = Link(cert_dir, qlog_on_the_test_clock, hooked=hooked).events()
        return [
            (event["data"]["header"]["packet_type"], [f["frame_type"] for f in frames])
            for event in events
            if event["name"] == "transport:packet_sent"
            and event["data"]["header"]["packet_type"] in ("initial", "handshake")
            and (frames := event["data"]["frames"])
        ]

    plain = handshake_packets(hooked=False)
    assert any("ack" in frames for _, frames in plain)
    assert handshake_packets(hooked=True) == plain


Step = tuple[str, int]
"""What happens to the next request's datagrams ("deliver", "drop", "hold"), then ms to wait."""


def acknowledgement_waits(link: Link, steps: list[Step]) -> list[float]:
    """For each ack-eliciting 1-RTT packet the server received, how long until it was acked."""
    held: list[bytes] = []
    for fate, wait_ms in steps:
        datagrams = link.request()
        if fate == "deliver":
            link.deliver(datagrams + held)  # what was held arrives late
            held = []
        elif fate == "hold":
            held += datagrams
        for _ in range(wait_ms + 1):
            link.server_packets()
            link.deliver(link.client_datagrams())  # the client's ACKs and retransmissions
            link.advance(MS)
    link.deliver(held)
    for _ in range(int(ACK_DELAY_S / MS) + 5):
        link.server_packets()
        link.advance(MS)

    received: dict[int, float] = {}
    acked: dict[int, float] = {}
    for event in link.events():
        data = event["data"]
        if data.get("header", {}).get("packet_type") != "1RTT":
            continue
        if event["name"] == "transport:packet_received":
            if {f["frame_type"] for f in data["frames"]} - NOT_ACK_ELICITING:
                received.setdefault(data["header"]["packet_number"], event["time"])
        elif event["name"] == "transport:packet_sent":
            for frame in data["frames"]:
                if frame["frame_type"] == "ack":
                    for first, last in frame["acked_ranges"]:
                        for number in range(first, last + 1):
                            acked.setdefault(number, event["time"])
    return [(acked.get(number, float("inf")) - at) / 1000 for number, at in received.items()]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["deliver", "drop", "hold"]), st.integers(0, 30)),
        min_size=1,
        max_size=10,
    )
)
def test_no_packet_waits_longer_than_the_delay_for_its_ack(
    cert_dir: Path, qlog_on_the_test_clock: Clock, steps: list[Step]
) -> None:
    link = Link(cert_dir, qlog_on_the_test_clock)
    waits = acknowledgement_waits(link, steps)
    assert waits  # the server received ack-eliciting packets
    assert max(waits) <= ACK_DELAY_S + 1e-9


def test_ack_upload_bench_smoke() -> None:
    body_bytes = 200_000
    runs = run_uploads(rounds=1, body_bytes=body_bytes)

    assert sorted(run.hooked for run in runs) == [False, True]
    assert all(run.server_cpu_s > 0 and run.server_datagrams > 0 for run in runs)
    assert "hooked/plain" in report(runs, body_bytes=body_bytes)
