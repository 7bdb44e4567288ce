"""The QUIC send path alone, in one process: CPU per SSE event with and without `tunnel.send_path`.

Strategy: a client and a server `QuicConnection` exchange datagrams in memory
on a simulated clock (1 ms a tick), so neither sockets, the engine nor the
load generator compete for the cores. The server answers `streams` open
requests with SSE-sized events at `tokens_per_s` each, with Pylon's credit
hook on (as every tunnel connection has it); only the server's own calls
(building packets, taking ACKs) are timed, with `time.process_time`.
Rounds alternate the hooked and the plain server, and the report gives the
median CPU per event of each and their ratio: on a shared machine that
ratio is steadier than a full `compare` run, whose other processes shift it.
"""

from __future__ import annotations

import random
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent
from aioquic.quic.logger import QuicLogger

from pylon.devcert import ensure_dev_certificate
from tunnel.flow import ConsumptionCredit
from tunnel.limits import TunnelLimits, grant_peer_streams
from tunnel.send_path import visit_only_busy_streams

CLIENT_ADDR = ("1.2.3.4", 1234)
SERVER_ADDR = ("2.3.4.5", 4433)
TICK_S = 0.001
EVENT = b"\x00\x7f\x40" + b"x" * 125
"""An HTTP/3 DATA frame of about one SSE token event (128 bytes)."""

ServerHook = Callable[[QuicConnection], None]


@dataclass
class MemoryPair:
    """A connected client and server; `tick` moves the clock and every datagram once."""

    client: QuicConnection
    server: QuicConnection
    now: float = 0.0
    server_cpu_s: float = 0.0
    """Process time spent inside the server's own calls."""
    client_events: list[QuicEvent] | None = None
    """The client's events, when a caller wants them (tests); None drops them."""

    def tick(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.now += TICK_S
            self._fire_timer(self.client)
            self._timed(lambda: self._fire_timer(self.server))
            for data, _ in self.client.datagrams_to_send(now=self.now):
                self._timed(partial(self.server.receive_datagram, data, CLIENT_ADDR, self.now))
            for data, _ in self._timed(lambda: self.server.datagrams_to_send(now=self.now)):
                self.client.receive_datagram(data, SERVER_ADDR, now=self.now)
            while (event := self.client.next_event()) is not None:
                if self.client_events is not None:
                    self.client_events.append(event)
            while self._timed(self.server.next_event) is not None:
                pass

    def _fire_timer(self, connection: QuicConnection) -> None:
        timer = connection.get_timer()
        if timer is not None and timer <= self.now:
            connection.handle_timer(now=self.now)

    def _timed(self, call: Callable[[], Any]) -> Any:
        started = time.process_time()
        try:
            return call()
        finally:
            self.server_cpu_s += time.process_time() - started


def connect(
    cert_dir: Path,
    *,
    server_hook: ServerHook | None = None,
    server_log: QuicLogger | None = None,
    max_streams: int = 128,
) -> MemoryPair:
    cert, key = ensure_dev_certificate(cert_dir)
    server_configuration = QuicConfiguration(
        is_client=False, alpn_protocols=["bench"], quic_logger=server_log
    )
    server_configuration.load_cert_chain(cert, key)
    client_configuration = QuicConfiguration(is_client=True, alpn_protocols=["bench"])
    client_configuration.verify_mode = ssl.CERT_NONE
    client = QuicConnection(configuration=client_configuration)
    server = QuicConnection(
        configuration=server_configuration,
        original_destination_connection_id=client.original_destination_connection_id,
    )
    grant_peer_streams(server, TunnelLimits(max_streams_per_connection=max_streams))
    if server_hook is not None:
        server_hook(server)
    client.connect(SERVER_ADDR, now=0.0)
    pair = MemoryPair(client=client, server=server)
    pair.tick(20)
    return pair


def open_streams(pair: MemoryPair, count: int) -> list[int]:
    stream_ids = []
    for _ in range(count):
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(stream_id, b"request", end_stream=True)
        stream_ids.append(stream_id)
    pair.tick(20)
    return stream_ids


@dataclass(frozen=True)
class SendPathRun:
    hooked: bool
    events: int
    server_cpu_s: float

    @property
    def cpu_per_event_s(self) -> float:
        return self.server_cpu_s / self.events


def run_once(
    cert_dir: Path, *, hooked: bool, streams: int, tokens_per_s: float, duration_s: float, seed: int
) -> SendPathRun:
    def as_pylon(server: QuicConnection) -> None:
        ConsumptionCredit(server, window_bytes=1 << 20)
        if hooked:
            visit_only_busy_streams(server)

    pair = connect(cert_dir, server_hook=as_pylon, max_streams=streams)
    stream_ids = open_streams(pair, streams)
    pair.server_cpu_s = 0.0
    chance = tokens_per_s * TICK_S
    arrivals = random.Random(seed)
    events = 0
    for _ in range(round(duration_s / TICK_S)):
        for stream_id in stream_ids:
            if arrivals.random() < chance:
                pair.server.send_stream_data(stream_id, EVENT)
                events += 1
        pair.tick()
    return SendPathRun(hooked=hooked, events=events, server_cpu_s=pair.server_cpu_s)


def run_sendpath(
    *, streams: int, tokens_per_s: float, duration_s: float, rounds: int
) -> list[SendPathRun]:
    runs = []
    with tempfile.TemporaryDirectory() as cert_dir:
        for index in range(rounds):
            for hooked in (index % 2 == 0, index % 2 == 1):  # alternate who goes first
                runs.append(
                    run_once(
                        Path(cert_dir),
                        hooked=hooked,
                        streams=streams,
                        tokens_per_s=tokens_per_s,
                        duration_s=duration_s,
                        seed=index,
                    )
                )
    return runs


def report(runs: list[SendPathRun]) -> str:
    def median_us(hooked: bool) -> float:
        return 1e6 * statistics.median(r.cpu_per_event_s for r in runs if r.hooked == hooked)

    plain, hooked = median_us(False), median_us(True)
    return (
        f"server CPU per event, median of {len(runs) // 2} rounds each:\n"
        f"  aioquic's walk            {plain:7.1f} us\n"
        f"  visit_only_busy_streams   {hooked:7.1f} us\n"
        f"  hooked/plain              {hooked / plain:7.2f}x"
    )
