"""A transmit with nothing to send builds no packet, and loses nothing by it.

`settled_without_packets` answers for aioquic's `datagrams_to_send`: when it
says there is nothing to send, the real call made right after must send
nothing and change nothing. Hypothesis drives a client and a server (with
every hook a tunnel connection has) through requests, answers, reads, resets,
pings and loss, in memory on a clock the test advances, and checks that at
every transmit. The end-to-end test counts, over a real QUIC connection, the
transmits that still build a packet for nothing.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aioquic import tls
from aioquic.quic.connection import QuicConnection, stream_is_client_initiated
from aioquic.quic.events import StreamDataReceived
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.sendpath import CLIENT_ADDR, SERVER_ADDR, TICK_S, connect
from tests.harness import run, stack, tunnel_headers
from tunnel import server as tunnel_server
from tunnel.acks import delay_acknowledgements
from tunnel.flow import ConsumptionCredit
from tunnel.send_path import settled_without_packets, visit_only_busy_streams

WINDOW_BYTES = 4096
"""Small, so that reads, stalls and credit updates happen within a few ticks."""


@dataclass
class ServerSide:
    """The server connection with a tunnel connection's hooks, and an application
    that reads request bodies only when told to."""

    quic: QuicConnection | None = None
    credit: ConsumptionCredit | None = None
    unread: dict[int, int] = field(default_factory=dict)
    stalls: int = 0
    settled: int = 0
    built: int = 0

    def install(self, quic: QuicConnection) -> None:
        # The order of `TunnelProtocol.__init__`.
        self.quic = quic
        # The peer's streams start with one window of credit, as a tunnel's do.
        quic._local_max_stream_data_bidi_remote = WINDOW_BYTES
        self.credit = ConsumptionCredit(quic, window_bytes=WINDOW_BYTES, on_stalled=self._stalled)
        visit_only_busy_streams(quic)
        delay_acknowledgements(quic)

    def _stalled(self, stream_id: int) -> None:
        self.stalls += 1

    def take_events(self) -> None:
        assert self.quic is not None and self.credit is not None
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, StreamDataReceived) and stream_is_client_initiated(
                event.stream_id
            ):
                if event.stream_id not in self.unread:
                    self.unread[event.stream_id] = 0
                    self.credit.track(event.stream_id)
                self.unread[event.stream_id] += len(event.data)
                self.credit.received(event.stream_id, len(event.data))

    def read(self, stream_id: int, byte_count: int) -> None:
        assert self.credit is not None
        taken = min(byte_count, self.unread.get(stream_id, 0))
        if taken:
            self.unread[stream_id] -= taken
            self.credit.consumed(stream_id, taken)


def snapshot(quic: QuicConnection) -> tuple[Any, ...]:
    """What a transmit could change besides the pacing time."""
    limits = (quic._local_max_data, quic._local_max_streams_bidi, quic._local_max_streams_uni)
    return (
        tuple(quic._streams),
        tuple(stream.stream_id for stream in quic._streams_queue),
        tuple((limit.value, limit.sent, limit.used) for limit in limits),
        tuple(
            (
                stream.stream_id,
                stream.max_stream_data_local,
                stream.max_stream_data_local_sent,
                stream.sender.buffer_is_empty,
                stream.sender.reset_pending,
                stream.receiver.stop_pending,
            )
            for stream in quic._streams.values()
        ),
        quic._spaces[tls.Epoch.ONE_RTT].ack_at,
        quic._packet_number,
        quic._probe_pending,
        tuple(quic._ping_pending),
        quic._handshake_done_pending,
    )


def transmit(side: ServerSide, now: float) -> list[tuple[bytes, Any]]:
    """The server's transmit, checking the claim each time it is made."""
    assert side.quic is not None and side.credit is not None
    if settled_without_packets(side.quic, now, side.credit.limit_to_write):
        side.settled += 1
        before, stalls = snapshot(side.quic), side.stalls
        assert side.quic.datagrams_to_send(now=now) == []
        assert snapshot(side.quic) == before
        assert side.stalls == stalls  # a stall the application must hear of was not missed
        return []
    side.built += 1
    return side.quic.datagrams_to_send(now=now)


def fire_timer(connection: QuicConnection, now: float) -> None:
    timer = connection.get_timer()
    if timer is not None and timer <= now:
        connection.handle_timer(now=now)


class Scenario:
    def __init__(self, cert_dir: Path) -> None:
        self.side = ServerSide()
        pair = connect(cert_dir, server_hook=self.side.install)
        self.client, self.server, self.now = pair.client, pair.server, pair.now
        self.side.take_events()
        self.streams: list[int] = []
        self.datagram_count = 0

    def stream(self, index: int) -> int | None:
        return self.streams[index % len(self.streams)] if self.streams else None

    def tick(self, loss_every: int) -> None:
        self.now += TICK_S
        fire_timer(self.client, self.now)
        fire_timer(self.server, self.now)
        for data, _ in self.client.datagrams_to_send(now=self.now):
            if not self._lost(loss_every):
                self.server.receive_datagram(data, CLIENT_ADDR, now=self.now)
        self.side.take_events()
        for data, _ in transmit(self.side, self.now):
            if not self._lost(loss_every):
                self.client.receive_datagram(data, SERVER_ADDR, now=self.now)
        while self.client.next_event() is not None:
            pass

    def _lost(self, loss_every: int) -> bool:
        self.datagram_count += 1
        return loss_every > 0 and self.datagram_count % loss_every == 0


def _quietly(call: Any, *args: Any, **kwargs: Any) -> None:
    """An action the connection refuses in its state (a stream already ended) is skipped."""
    with contextlib.suppress(ValueError, AssertionError, RuntimeError):
        call(*args, **kwargs)


def act(scenario: Scenario, action: tuple[Any, ...]) -> None:
    kind, *args = action
    client, server, side = scenario.client, scenario.server, scenario.side
    if kind == "open":
        size, fin = args
        stream_id = client.get_next_available_stream_id()
        client.send_stream_data(stream_id, bytes(size), end_stream=fin)
        scenario.streams.append(stream_id)
        return
    if kind == "tick":
        steps, loss_every = args
        for _ in range(steps):
            scenario.tick(loss_every)
        return
    if kind == "ping":
        server.send_ping(len(server._ping_pending))
        return
    stream_id = scenario.stream(args[0])
    if stream_id is None:
        return
    if kind == "send":
        _quietly(client.send_stream_data, stream_id, bytes(args[1]), end_stream=args[2])
    elif kind == "answer":
        if stream_id in server._streams:
            _quietly(server.send_stream_data, stream_id, bytes(args[1]), end_stream=args[2])
    elif kind == "read":
        side.read(stream_id, args[1])
    elif kind == "reset" and stream_id in server._streams:
        _quietly(server.reset_stream, stream_id, error_code=0x10C)
    elif kind == "stop" and stream_id in server._streams:
        _quietly(server.stop_stream, stream_id, error_code=0x10C)
    elif kind == "client_reset":
        _quietly(client.reset_stream, stream_id, error_code=0x10C)


index = st.integers(0, 7)
size = st.sampled_from([0, 1, 100, 1200, 5000])
actions = st.lists(
    st.one_of(
        st.tuples(st.just("open"), size, st.booleans()),
        st.tuples(st.just("send"), index, size, st.booleans()),
        st.tuples(st.just("answer"), index, size, st.booleans()),
        st.tuples(st.just("read"), index, st.sampled_from([1, 500, 4096, 100_000])),
        st.tuples(st.sampled_from(["reset", "stop", "client_reset"]), index),
        st.tuples(st.just("ping")),
        st.tuples(st.just("tick"), st.integers(1, 30), st.sampled_from([0, 0, 3, 7])),
    ),
    max_size=30,
)


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("idle-transmit-cert")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=actions)
def test_a_transmit_said_to_have_nothing_to_send_sends_and_changes_nothing(
    cert_dir: Path, steps: list[tuple[Any, ...]]
) -> None:
    scenario = Scenario(cert_dir)
    for step in steps:
        act(scenario, step)
    # The application reads every body to its end, so the connection comes to rest,
    # where the claim is made and checked.
    for _ in range(200):
        act(scenario, ("tick", 5, 0))
        if not any(scenario.side.unread.values()):
            break
        for stream_id in scenario.side.unread:
            scenario.side.read(stream_id, 1 << 30)
    act(scenario, ("tick", 200, 0))
    assert scenario.side.settled > 0


def test_an_answered_request_leaves_nothing_to_send_and_its_stream_dropped(
    cert_dir: Path,
) -> None:
    scenario = Scenario(cert_dir)
    act(scenario, ("open", 100, True))
    act(scenario, ("tick", 3, 0))
    (stream_id,) = scenario.streams
    assert stream_id in scenario.server._streams
    act(scenario, ("read", 0, 100))
    act(scenario, ("answer", 0, 100, True))
    settled_before = scenario.side.settled
    act(scenario, ("tick", 50, 0))

    assert scenario.side.settled > settled_before
    assert stream_id not in scenario.server._streams
    assert all(stream.stream_id != stream_id for stream in scenario.server._streams_queue)


@pytest.mark.parametrize(
    "pending",
    ["stream data", "ack due", "ping", "stalled reader", "stream credit due"],
)
def test_anything_pending_means_a_packet_is_built(cert_dir: Path, pending: str) -> None:
    scenario = Scenario(cert_dir)
    act(scenario, ("open", 100, False))
    act(scenario, ("tick", 40, 0))
    server, side = scenario.server, scenario.side
    assert side.credit is not None
    assert settled_without_packets(server, scenario.now, side.credit.limit_to_write)
    (stream_id,) = scenario.streams
    if pending == "stream data":
        server.send_stream_data(stream_id, b"token")
    elif pending == "ack due":
        server._spaces[tls.Epoch.ONE_RTT].ack_at = scenario.now
    elif pending == "ping":
        server.send_ping(1)
    elif pending == "stalled reader":
        scenario.client.send_stream_data(stream_id, bytes(WINDOW_BYTES))
        for _ in range(40):
            scenario.tick(0)
        assert side.unread[stream_id] == WINDOW_BYTES  # the peer is at its limit
        assert side.stalls > 0
    elif pending == "stream credit due":
        limit = server._local_max_streams_bidi
        limit.used = limit.sent  # the peer has opened every stream it may,
        limit.value += 1  # and one has closed
    assert not settled_without_packets(server, scenario.now, side.credit.limit_to_write)
    before = side.stalls
    assert transmit(side, scenario.now) != [] or side.stalls > before


# --- end to end: one request at a time over a real QUIC connection ------------------


def count_server_builds(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls into the server's packet builder that sent nothing, and that sent datagrams."""
    counts = {"built_nothing": 0, "built": 0}
    datagrams_to_send = QuicConnection.datagrams_to_send

    def counted(self: QuicConnection, now: float) -> list[tuple[bytes, Any]]:
        datagrams = datagrams_to_send(self, now)
        if not self._is_client:
            counts["built" if datagrams else "built_nothing"] += 1
        return datagrams

    monkeypatch.setattr(QuicConnection, "datagrams_to_send", counted)
    return counts


@pytest.mark.e2e
@pytest.mark.parametrize("idle_check", [True, False])
def test_small_requests_build_a_packet_only_to_send_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_check: bool
) -> None:
    if not idle_check:
        monkeypatch.setattr(tunnel_server, "settled_without_packets", lambda *args: False)
    counts = count_server_builds(monkeypatch)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    requests = 40

    async def scenario() -> None:
        async with stack(tmp_path) as pylon, pylon.client() as client:
            response = await client.request(
                "POST", "/v1/chat/completions", body=body, headers=tunnel_headers("warm-up")
            )
            await response.read()
            counts.update(built_nothing=0, built=0)
            for number in range(requests):
                response = await client.request(
                    "POST",
                    "/v1/chat/completions",
                    body=body,
                    headers=tunnel_headers(f"r-{number}"),
                )
                assert response.status == 200
                await response.read()

    run(scenario())
    assert counts["built"] >= requests  # every response left
    if idle_check:
        assert counts["built_nothing"] < requests / 4
    else:  # the control: without the check, each request builds for nothing twice or more
        assert counts["built_nothing"] > requests
