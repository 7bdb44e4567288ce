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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

    def write(self, data: bytes) -> bool:
        if self.fail_with is not None:
            raise self.fail_with
        self.chunks.append(data)
        self.held += len(data)
        self.peak_held = max(self.peak_held, self.held)
        return self.held <= self.cap

    async def wait_drained(self) -> None:
        self.waits += 1
        self.drained.clear()
        await self.drained.wait()

    def drain(self) -> None:
        self.held = 0
        self.drained.set()

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@contextlib.asynccontextmanager
async def pooled() -> AsyncIterator[H11Transport]:
    """A transport whose pooled connections are closed at the end."""
    h11_transport = transport()
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
) -> None:
    request = httpx.Request("GET", url, extensions={"timeout": {"read": None}})
    response = await h11_transport.handle_async_request(request)
    body = response.stream
    assert isinstance(body, ResponseBody)

    def first_chunk() -> None:
        if first_chunks is not None:
            first_chunks.append(len(sink.chunks))

    await body.relay(sink, idle_timeout_s=idle_timeout_s, on_first_chunk=first_chunk)


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

    run(scenario())


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
        async with Engine(blast) as engine, pooled() as h11_transport:
            task = asyncio.ensure_future(relay(h11_transport, engine.url, sink))
            while not task.done():
                assert await eventually(lambda: sink.waits > 0 or task.done(), within_s=5)
                written = len(sink.body)
                await asyncio.sleep(0.02)  # backlogged: the engine's bytes must wait
                assert task.done() or len(sink.body) == written
                sink.waits = 0
                sink.drain()
            await task
            assert sink.body == body
            assert sink.peak_held <= cap + piece
            assert max(len(chunk) for chunk in sink.chunks) <= piece
            assert h11_transport.stats().idle == 1  # complete, so the connection is reused

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
            assert asyncio.get_running_loop().time() - started >= idle_s
            assert sink.body == b"data: 1\n\n"
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
            with pytest.raises(httpx.TransportError) as raised:
                await relay(h11_transport := transport(), engine.url, Sink())
            assert type(raised.value) is failure.raised
            assert h11_transport.stats().open == 0

    run(scenario())


def test_a_protocol_error_mid_body_is_a_remote_protocol_error() -> None:
    async def bad_chunk(exchange: Exchange) -> None:
        await exchange.write_raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")

    async def scenario() -> None:
        async with Engine(bad_chunk) as engine:
            with pytest.raises(httpx.RemoteProtocolError):
                await relay(h11_transport := transport(), engine.url, Sink())
            assert h11_transport.stats().open == 0

    run(scenario())


def test_bytes_after_the_body_retire_the_connection() -> None:
    async def trailing_garbage(exchange: Exchange) -> None:
        await exchange.write_raw(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA")

    async def scenario() -> None:
        async with Engine(trailing_garbage) as engine:
            sink = Sink()
            await relay(h11_transport := transport(), engine.url, sink)
            assert sink.body == b"ok"
            assert h11_transport.stats().open == 0

    run(scenario())


def test_a_failing_sink_or_a_cancelled_relay_closes_the_connection() -> None:
    async def scenario() -> None:
        async with Engine(endless_stream) as engine:
            h11_transport = transport()
            sink = Sink(fail_with=ConnectionAbortedError("the gateway went away"))
            with pytest.raises(ConnectionAbortedError):
                await relay(h11_transport, engine.url, sink)
            assert h11_transport.stats().open == 0

            sink = Sink()
            task = asyncio.ensure_future(relay(h11_transport, engine.url, sink))
            assert await eventually(lambda: len(sink.chunks) >= 2, within_s=5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert h11_transport.stats().open == 0
            assert await eventually(lambda: engine.gone == 2, within_s=5)

    run(scenario())
