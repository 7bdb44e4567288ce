"""How `TunnelService` frames a request body toward the engine, with the timing pinned.

A body already complete when the handler runs goes out in one write with a
Content-Length; a body still arriving is streamed (chunked: the gateway sent
no length). Through QUIC the outcome depended on whether the handler started
before or after the DATA frame was fed, which differs between event loops. So
these tests drive a real service (passthrough adapter, h11 transport, a real
loopback HTTP/1.1 engine) with a `TunnelStream` they feed themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from backends.registry import build_adapter
from pylon.app import build_service
from pylon.auth import TunnelAuth
from pylon.config import Settings, UpstreamSettings
from pylon.forwarder import Forwarder, build_upstream_transport
from pylon.metrics import DenyList, Metrics
from pylon.service import TunnelService
from tests.harness import CHAT, eventually, run
from tests.test_upstream_transport import Engine, Exchange, ok
from tunnel.stream import TunnelStream
from tunnel.types import HeaderList, RequestHead, StreamAborted

BODY = b'{"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}'


@dataclass
class Owner:
    """A `StreamOwner` that records what the service answers on the stream."""

    heads: list[HeaderList] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    resets: list[int] = field(default_factory=list)
    consumed: int = 0

    def stream_send_headers(self, stream_id: int, headers: HeaderList, *, end: bool) -> None:
        self.heads.append(headers)
        self.ended |= end

    def stream_send_data(self, stream_id: int, data: bytes, *, end: bool) -> None:
        self.data += data
        self.ended |= end

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        self.resets.append(error_code)

    def stream_queued_bytes(self, stream_id: int) -> int:
        return 0

    def stream_consumed(self, stream_id: int, byte_count: int) -> None:
        self.consumed += byte_count

    def stream_awaits_drain(self, stream: TunnelStream) -> None:
        raise AssertionError("nothing is ever queued, so no writer waits")


@contextlib.asynccontextmanager
async def service_for(url: str) -> AsyncIterator[TunnelService]:
    """A `TunnelService` built by `pylon.app.build_service` (no auth), toward `url`."""
    settings = Settings(upstream=UpstreamSettings(url=url))
    adapter = build_adapter(settings.backend, settings.priority)
    transport = build_upstream_transport(settings.upstream)
    metrics = Metrics(
        CollectorRegistry(), backend=adapter.name, version="test", deny_list=DenyList.of(adapter)
    )
    service = build_service(
        settings,
        adapter=adapter,
        forwarder=Forwarder(transport, settings.upstream),
        metrics=metrics,
        tracing=None,
        auth=TunnelAuth(client=None, tokens=None),
    )
    try:
        yield service
    finally:
        await transport.aclose()  # before the engine waits for its connections to close


def chat_stream(owner: Owner, *, read_batch_bytes: int = 4) -> TunnelStream:
    headers = ((b"content-type", b"application/json"), (b"x-request-id", b"frame-1"))
    head = RequestHead(method="POST", scheme="https", authority="pylon", path=CHAT, headers=headers)
    return TunnelStream(
        stream_id=0,
        head=head,
        owner=owner,
        max_queued_bytes=1 << 20,
        read_batch_bytes=read_batch_bytes,
    )


def assert_answered(owner: Owner, engine: Engine) -> Exchange:
    """The engine got the exact body once and its answer reached the stream complete."""
    [exchange] = engine.requests
    assert exchange.body == BODY
    [head] = owner.heads
    assert (b":status", b"200") in head
    assert (b"content-length", str(len(b"ok:" + BODY)).encode()) in head
    assert bytes(owner.data) == b"ok:" + BODY
    assert owner.ended and not owner.resets
    return exchange


def test_body_received_before_the_handler_goes_with_content_length() -> None:
    async def scenario() -> None:
        owner = Owner()
        async with Engine(ok) as engine, service_for(engine.url) as service:
            stream = chat_stream(owner)
            stream.feed(BODY[:10], end=False)
            stream.feed(BODY[10:], end=True)
            assert stream.received_all
            await service(stream)
            exchange = assert_answered(owner, engine)
        assert exchange.header(b"content-length") == str(len(BODY)).encode()
        assert exchange.header(b"transfer-encoding") is None
        assert owner.consumed == len(BODY)  # the gateway gets its flow-control credit back

    run(scenario())


def test_taking_a_received_body_takes_it_once_and_fails_on_a_reset_stream() -> None:
    owner = Owner()
    stream = chat_stream(owner)
    stream.feed(b"ab", end=False)
    stream.feed(b"cd", end=True)
    assert stream.take_received() == b"abcd"
    assert stream.take_received() == b""
    assert owner.consumed == 4
    stream.abort(0x10C)
    with pytest.raises(StreamAborted):
        stream.take_received()


def test_body_still_arriving_is_streamed_chunked() -> None:
    async def scenario() -> None:
        owner = Owner()
        async with Engine(ok) as engine, service_for(engine.url) as service:
            stream = chat_stream(owner)
            stream.feed(BODY[:10], end=False)
            handler = asyncio.ensure_future(service(stream))
            # The handler is past the framing decision once it has read the first part.
            assert await eventually(lambda: owner.consumed == 10, within_s=5)
            assert not handler.done() and not stream.received_all
            stream.feed(BODY[10:], end=True)
            await handler
            exchange = assert_answered(owner, engine)
        assert exchange.header(b"transfer-encoding") == b"chunked"
        assert exchange.header(b"content-length") is None

    run(scenario())


def test_receiving_takes_a_batch_at_once_and_credits_it_together() -> None:
    async def scenario() -> None:
        owner = Owner()
        stream = chat_stream(owner, read_batch_bytes=6)
        waiting = asyncio.ensure_future(stream.receive())
        for chunk in (b"ab", b"cd"):
            stream.feed(chunk, end=False)
            await asyncio.sleep(0)
            assert not waiting.done()  # short of a batch: it waits for more
        stream.feed(b"ef", end=False)
        assert await waiting == b"abcdef"
        assert owner.consumed == 6
        waiting = asyncio.ensure_future(stream.receive())
        stream.feed(b"g", end=False)
        await asyncio.sleep(0)
        assert not waiting.done()
        stream.feed(b"h", end=True)  # the end hands over the rest, short of a batch
        assert await waiting == b"gh"
        assert await stream.receive() == b""
        assert owner.consumed == 8

    run(scenario())


def test_a_stalled_peer_gets_what_is_buffered_read_short_of_a_batch() -> None:
    async def scenario() -> None:
        owner = Owner()
        stream = chat_stream(owner, read_batch_bytes=1 << 20)
        stream.hand_over()  # nothing buffered: nothing to hand over
        waiting = asyncio.ensure_future(stream.receive())
        await asyncio.sleep(0)
        assert not waiting.done()
        stream.feed(b"abc", end=False)
        await asyncio.sleep(0)
        assert not waiting.done()
        stream.hand_over()  # what flow control does once the peer cannot send more
        assert await waiting == b"abc"
        assert owner.consumed == 3

    run(scenario())


def test_a_trickling_body_is_read_once_idle_and_then_times_out() -> None:
    async def scenario() -> None:
        owner = Owner()
        stream = chat_stream(owner, read_batch_bytes=1 << 20)
        idle_s = 0.2
        waiting = asyncio.ensure_future(stream.receive(idle_s))
        loop = asyncio.get_running_loop()
        started = loop.time()
        for chunk in (b"ab", b"cd", b"ef"):  # each within idle_s of the one before
            await asyncio.sleep(idle_s / 2)
            stream.feed(chunk, end=False)
        assert not waiting.done()
        # Idle from the last byte on: the read returns what is there, not an error.
        assert await waiting == b"abcdef"
        assert loop.time() - started >= 1.5 * idle_s + idle_s * 0.9
        # Nothing more came: the silence already lasted idle_s, so the next read
        # fails at once rather than restarting the clock.
        with pytest.raises(TimeoutError, match="no request body bytes"):
            await asyncio.wait_for(stream.receive(idle_s), timeout=idle_s / 2)

    run(scenario())


def test_a_byte_after_an_idle_read_restarts_the_idle_clock() -> None:
    async def scenario() -> None:
        owner = Owner()
        stream = chat_stream(owner, read_batch_bytes=1 << 20)
        idle_s = 0.2
        stream.feed(b"ab", end=False)
        assert await stream.receive(idle_s) == b"ab"  # returned on the idle clock
        stream.feed(b"cd", end=False)
        waiting = asyncio.ensure_future(stream.receive(idle_s))
        await asyncio.sleep(idle_s / 2)
        assert not waiting.done()  # idle counts from "cd", not from before it
        stream.feed(b"ef", end=True)
        assert await waiting == b"cdef"

    run(scenario())


def test_receiving_on_a_reset_stream_fails_even_with_chunks_queued() -> None:
    async def scenario() -> None:
        owner = Owner()
        stream = chat_stream(owner)
        stream.feed(b"ab", end=False)
        stream.abort(0x10C)
        with pytest.raises(StreamAborted):
            await stream.receive()

    run(scenario())
