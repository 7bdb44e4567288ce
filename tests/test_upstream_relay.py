"""The h11 transport's push path (`ResponseBody.relay`) against scripted loopback engines.

The relay parses each socket read in the reader's callback and writes body
chunks straight into a sink, so these tests check what that must not lose:
the exact bytes under any framing and any split, one chunk per SSE event as
it arrives, backpressure that stops reading the engine while the sink is
backlogged, an idle budget that does not count time spent backlogged, every
failure as the pull path raises it, and the connection's fate afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pylon.upstream_connection import Streams, open_tcp
from pylon.upstream_pump import BodyPump
from pylon.upstream_transport import H11Transport, ResponseBody
from tests.harness import eventually, run
from tests.test_upstream_transport import (
    FAILURES,
    Engine,
    Exchange,
    _chunked,
    _split,
    endless_stream,
    transport,
)


@dataclass
class Sink:
    """Records what the relay wrote; backlogged while more than `cap` bytes are held."""

    cap: int = 1 << 30
    chunks: list[bytes] = field(default_factory=list)
    held: int = 0
    """Bytes written and not yet let go by `drain`."""
    peak_held: int = 0
    waits: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    fail_with: Exception | None = None
    ended: int = 0
    order: list[str] = field(default_factory=list)
    """"write" and "end" as called, and "tick" when the loop ran a callback after a write."""

    def write(self, data: bytes) -> bool:
        if self.fail_with is not None:
            raise self.fail_with
        if self.ended:
            raise RuntimeError("write after end")
        self.order.append("write")
        asyncio.get_running_loop().call_soon(self.order.append, "tick")
        self.chunks.append(data)
        self.held += len(data)
        self.peak_held = max(self.peak_held, self.held)
        return self.held <= self.cap

    async def wait_drained(self) -> None:
        self.waits += 1
        self.drained.clear()
        await self.drained.wait()

    def end(self, last: bytes = b"") -> None:
        self.ended += 1
        self.order.append("end")
        if last:
            self.chunks.append(last)

    def drain(self) -> None:
        self.held = 0
        self.drained.set()

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class Recorded:
    """The streams of every connection the transport opened, to look at the socket."""

    opened: list[Streams] = field(default_factory=list)

    async def __call__(self, host: str, port: int, tls: ssl.SSLContext | None) -> Streams:
        streams = await open_tcp(host, port, tls)
        self.opened.append(streams)
        return streams


@contextlib.asynccontextmanager
async def pooled(**kwargs: Any) -> AsyncIterator[H11Transport]:
    """A transport whose pooled connections are closed at the end."""
    h11_transport = transport(**kwargs)
    try:
        yield h11_transport
    finally:
        await h11_transport.aclose()


async def relay(
    h11_transport: H11Transport,
    url: str,
    sink: Sink,
    *,
    idle_timeout_s: float | None = None,
    first_chunks: list[int] | None = None,
    settle_s: float = 0.0,
) -> None:
    """One GET relayed into `sink`; `settle_s` lets the engine's bytes arrive before it starts."""
    request = httpx.Request("GET", url, extensions={"timeout": {"read": None}})
    response = await h11_transport.handle_async_request(request)
    body = response.stream
    assert isinstance(body, ResponseBody)

    def first_chunk() -> None:
        if first_chunks is not None:
            first_chunks.append(len(sink.chunks))

    if settle_s:
        await asyncio.sleep(settle_s)
    await body.relay(sink, idle_timeout_s=idle_timeout_s, on_first_chunk=first_chunk)


async def drain_while_waited_on(sink: Sink, task: asyncio.Future[None]) -> None:
    """Let the sink go each time the relay waits on it, until the relay ends."""
    while not task.done():
        assert await eventually(lambda: sink.waits > 0 or task.done(), within_s=5)
        sink.waits = 0
        sink.drain()


async def write_paced(exchange: Exchange, writes: list[bytes]) -> None:
    """Each of the engine's writes, 50 ms apart, so each lands in a read of its own."""
    for data in writes:
        await exchange.write_raw(data)
        await asyncio.sleep(0.05)


def framed(body: bytes, framing: str, chunk_sizes: list[int]) -> bytes:
    if framing == "chunked":
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        return head + _chunked(body, chunk_sizes)
    if framing == "content-length":
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    return b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + body


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.binary(max_size=3000),
    chunk_sizes=st.lists(st.integers(1, 700), max_size=8),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
    framing=st.sampled_from(["chunked", "content-length", "until-close"]),
)
def test_any_framing_and_split_relays_the_exact_body(
    body: bytes, chunk_sizes: list[int], cuts: list[int], framing: str
) -> None:
    """Framing and body cut anywhere into socket writes, some landing with the head."""
    wire = framed(body, framing, chunk_sizes)

    async def split_writes(exchange: Exchange) -> None:
        for piece in _split(wire, cuts):
            await exchange.write_raw(piece)
            await asyncio.sleep(0)
        if framing == "until-close":
            exchange.writer.close()

    async def scenario() -> None:
        async with Engine(split_writes) as engine, pooled() as h11_transport:
            for _ in range(2):
                first_chunks: list[int] = []
                sink = Sink()
                await relay(h11_transport, engine.url, sink, first_chunks=first_chunks)
                assert sink.body == body
                assert sink.ended == 1
                assert first_chunks == ([0] if body else [])
            # Framed bodies leave the connection reusable; a body ended by the close cannot.
            assert engine.connections == (2 if framing == "until-close" else 1)

    run(scenario())


def test_each_sse_event_reaches_the_sink_before_the_engine_sends_the_next() -> None:
    async def scenario() -> None:
        sink = Sink()

        async def lockstep(exchange: Exchange) -> None:
            exchange.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
            for n in range(3):
                exchange.send(h11.Data(data=b"data: %d\n\n" % n))
                await exchange.writer.drain()
                assert await eventually(lambda n=n: len(sink.chunks) == n + 1, within_s=5)
            exchange.send(h11.EndOfMessage())

        async with Engine(lockstep) as engine, pooled() as h11_transport:
            await relay(h11_transport, engine.url, sink)
            assert sink.chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            assert h11_transport.stats().idle == 1  # all pushed, so the connection is reused
            sink = Sink()
            await relay(h11_transport, engine.url, sink)
            assert sink.chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            assert engine.connections == 1

    run(scenario())


LAST_BYTES = {
    "with the head": [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"],
    "in a read of their own": [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"ok"],
    "with the last chunk": [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        b"2\r\nok\r\n0\r\n\r\n",
    ],
}
"""The engine's writes, 50 ms apart; the last one ends the body."""


def relayed_paced(writes: list[bytes], *, idle_timeout_s: float | None = None) -> Sink:
    """What a sink got from an engine writing `writes` 50 ms apart."""

    async def paced(exchange: Exchange) -> None:
        await write_paced(exchange, writes)

    async def scenario() -> Sink:
        async with Engine(paced) as engine, pooled() as h11_transport:
            sink = Sink()
            await relay(h11_transport, engine.url, sink, idle_timeout_s=idle_timeout_s)
            return sink

    return run(scenario())


@pytest.mark.parametrize("writes", LAST_BYTES.values(), ids=LAST_BYTES.keys())
def test_the_last_bytes_reach_the_sink_with_the_end(writes: list[bytes]) -> None:
    """So the tunnel sends them in one DATA frame with the FIN, not in two writes."""
    sink = relayed_paced(writes)
    assert (sink.body, sink.order) == (b"ok", ["end"])


def test_a_body_whole_with_the_head_arms_no_idle_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle budget is watched only for a body still to come (it is timed from the
    last bytes either way, so the deadline does not move)."""
    armed: list[bool] = []
    watch_idle = BodyPump.watch_idle

    def spy(pump: BodyPump) -> None:
        watch_idle(pump)
        armed.append(pump._idle_timer is not None)

    monkeypatch.setattr(BodyPump, "watch_idle", spy)
    whole = relayed_paced([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"], idle_timeout_s=5)
    assert (whole.body, armed) == (b"ok", [])
    later = relayed_paced(
        [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"ok"], idle_timeout_s=5
    )
    assert (later.body, armed) == (b"ok", [True])


def test_an_end_in_a_read_of_its_own_still_ends_the_sink() -> None:
    """The last bytes are written when they come; the end follows on its own read."""
    sink = relayed_paced(
        [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n", b"0\r\n\r\n"]
    )
    assert (sink.body, sink.ended) == (b"ok", 1)
    assert sink.order[0] == "write" and sink.order[-1] == "end"


def test_a_backlogged_sink_stops_reading_the_engine_and_loses_nothing() -> None:
    """4 MiB written as fast as the engine can, into a sink that drains only when told."""
    body = bytes(range(256)) * (16 * 1024)
    cap = 128 * 1024
    piece = 64 * 1024
    """What one pull read takes: the relay writes no more than this past the cap."""

    async def blast(exchange: Exchange) -> None:
        await exchange.write_raw(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        await exchange.write_raw(body)

    async def scenario() -> None:
        sink = Sink(cap=cap)
        recorded = Recorded()
        async with Engine(blast) as engine, pooled(open_connection=recorded) as h11_transport:
            task = asyncio.ensure_future(relay(h11_transport, engine.url, sink))
            backlogged = 0
            while not task.done():
                assert await eventually(lambda: sink.waits > 0 or task.done(), within_s=5)
                if not task.done():
                    backlogged += 1
                    reader, writer = recorded.opened[0]
                    assert not writer.transport.is_reading()
                    written, fed = len(sink.body), reader.fed_bytes
                    await asyncio.sleep(0.02)  # backlogged: the engine's bytes must wait
                    assert (len(sink.body), reader.fed_bytes) == (written, fed)
                sink.waits = 0
                sink.drain()
            await task
            assert backlogged > 1
            assert sink.body == body
            assert sink.peak_held <= cap + piece
            assert max(len(chunk) for chunk in sink.chunks) <= piece
            assert h11_transport.stats().idle == 1  # complete, so the connection is reused
            assert recorded.opened[0][1].transport.is_reading()  # the pool sees what comes

    run(scenario())


def test_an_engine_silent_mid_body_times_out_but_a_backlogged_wait_does_not() -> None:
    async def scenario() -> None:
        idle_s = 0.2
        go_on = asyncio.Event()

        async def one_then_wait(exchange: Exchange) -> None:
            """One token, then silence until told; then the last token and the end."""
            exchange.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
            exchange.send(h11.Data(data=b"data: 1\n\n"))
            await exchange.writer.drain()
            while not go_on.is_set():
                if exchange.peer_gone():
                    return
                await asyncio.sleep(0.01)
            exchange.send(h11.Data(data=b"data: 2\n\n"))
            exchange.send(h11.EndOfMessage())
            await exchange.writer.drain()

        async with Engine(one_then_wait) as engine, pooled() as h11_transport:
            sink = Sink()
            started = asyncio.get_running_loop().time()
            with pytest.raises(httpx.ReadTimeout):
                await relay(h11_transport, engine.url, sink, idle_timeout_s=idle_s)
            # The loop clock ticks in whole milliseconds: allow one tick.
            assert asyncio.get_running_loop().time() - started >= idle_s - 0.001
            assert sink.body == b"data: 1\n\n"
            assert sink.ended == 0
            assert h11_transport.stats().open == 0

            # Backlogged from the first token for 3 idle periods, the engine silent
            # meanwhile: that wait is the gateway's, so the relay goes on after it.
            sink = Sink(cap=0)
            task = asyncio.ensure_future(
                relay(h11_transport, engine.url, sink, idle_timeout_s=idle_s)
            )
            await asyncio.sleep(3 * idle_s)
            assert not task.done()
            sink.cap = 1 << 30
            sink.drain()
            go_on.set()
            await task
            assert sink.body == b"data: 1\n\ndata: 2\n\n"

    run(scenario())


MID_BODY = ["closed mid-body", "closed mid-chunk", "reset mid-body"]


@pytest.mark.parametrize("name", MID_BODY)
def test_engine_failures_mid_body_raise_the_pull_paths_errors(name: str) -> None:
    failure = FAILURES[name]

    async def scenario() -> None:
        async with Engine(failure.handler) as engine:
            sink = Sink()
            with pytest.raises(httpx.TransportError) as raised:
                await relay(h11_transport := transport(), engine.url, sink)
            assert type(raised.value) is failure.raised
            assert sink.ended == 0  # a cut body must never end like a complete one
            assert h11_transport.stats().open == 0

    run(scenario())


@pytest.mark.parametrize(
    ("framing", "raised"),
    [(b"content-length: %d\r\n" % (200 * 1024), httpx.RemoteProtocolError), (b"", None)],
    ids=["framed body cut", "body until close"],
)
def test_a_close_while_backlogged_ends_the_body_after_what_came_before(
    framing: bytes, raised: type[Exception] | None
) -> None:
    """All of it, close included, is in before the relay starts, into a sink that is full
    after every write: every byte the engine sent still goes out before the close counts."""
    sent = bytes(range(256)) * 400  # over one read, so some waits in the reader's buffer
    piece = 64 * 1024

    async def write_and_close(exchange: Exchange) -> None:
        await exchange.write_raw(b"HTTP/1.1 200 OK\r\n%s\r\n" % framing + sent)
        exchange.writer.close()

    async def scenario() -> None:
        sink = Sink(cap=0)
        async with Engine(write_and_close) as engine:
            task = asyncio.ensure_future(
                relay(h11_transport := transport(), engine.url, sink, settle_s=0.05)
            )
            await drain_while_waited_on(sink, task)
            if raised is None:
                await task
            else:
                with pytest.raises(raised):
                    await task
            assert sink.body == sent
            assert sink.ended == (1 if raised is None else 0)
            assert sink.peak_held <= piece  # full after each write, so given nothing more
            assert h11_transport.stats().open == 0

    run(scenario())


def test_a_protocol_error_mid_body_is_a_remote_protocol_error() -> None:
    async def bad_chunk(exchange: Exchange) -> None:
        await exchange.write_raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for data in (b"4\r\nokay\r\n", b"zz\r\n"):  # the relay reads both
            await asyncio.sleep(0.05)
            await exchange.write_raw(data)

    async def scenario() -> None:
        async with Engine(bad_chunk) as engine:
            sink = Sink()
            with pytest.raises(httpx.RemoteProtocolError):
                await relay(h11_transport := transport(), engine.url, sink)
            assert sink.body == b"okay"
            assert sink.ended == 0
            assert h11_transport.stats().open == 0

    run(scenario())


AFTER_THE_BODY = {
    "in the head's read": [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA"],
    "in the body's read": [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"okEXTRA"],
    "a next head": [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n",
        b"okHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    ],
    "a read of its own": [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"ok", b"EXTRA"],
}
"""The engine's writes, 50 ms apart: bytes after a complete body in every place they land."""


@pytest.mark.parametrize("writes", AFTER_THE_BODY.values(), ids=AFTER_THE_BODY.keys())
def test_bytes_after_the_body_retire_the_connection(writes: list[bytes]) -> None:
    first = True

    async def trailing_bytes(exchange: Exchange) -> None:
        nonlocal first
        if not first:  # the request after, on a new connection: a clean answer
            await exchange.reply(b"ok")
            return
        first = False
        await write_paced(exchange, writes)

    async def scenario() -> None:
        async with Engine(trailing_bytes) as engine, pooled() as h11_transport:
            for _ in range(2):
                sink = Sink()
                await relay(h11_transport, engine.url, sink)
                assert sink.body == b"ok"
                await asyncio.sleep(0.1)  # "a read of its own" arrives after the relay
            assert engine.connections == 2

    run(scenario())


def test_a_failing_sink_or_a_cancelled_relay_closes_the_connection() -> None:
    async def scenario() -> None:
        recorded = Recorded()
        async with Engine(endless_stream) as engine:
            h11_transport = transport(open_connection=recorded)
            sink = Sink(fail_with=ConnectionAbortedError("the gateway went away"))
            with pytest.raises(ConnectionAbortedError):
                await relay(h11_transport, engine.url, sink)
            assert sink.ended == 0
            assert h11_transport.stats().open == 0

            waiting_for_the_engine = Sink()
            waiting_for_the_sink = Sink(cap=0)
            for sink, started in [
                (waiting_for_the_engine, lambda: len(waiting_for_the_engine.chunks) >= 2),
                (waiting_for_the_sink, lambda: waiting_for_the_sink.waits > 0),
            ]:
                task = asyncio.ensure_future(relay(h11_transport, engine.url, sink))
                assert await eventually(started, within_s=5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert sink.ended == 0
                assert h11_transport.stats().open == 0
            assert await eventually(lambda: engine.gone == 3, within_s=5)
            assert all(reader.pump is None for reader, _ in recorded.opened)

    run(scenario())
