"""The h11 upstream transport against real loopback servers, well-behaved and not.

`Engine` is a tiny HTTP/1.1 server written here so a test can script what the
engine does on the wire (stall, close mid-body, split its writes); the
project's mock engine checks the transport against a real engine too. The
retry rule through the forwarder is in test_reliability_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.mock import MockEngine, MockEngineOptions
from pylon.devcert import ensure_dev_certificate
from pylon.errors import (
    UpstreamError,
    UpstreamNotReady,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnreachable,
    upstream_error_for,
)
from pylon.upstream_connection import Streams, open_tcp
from pylon.upstream_transport import H11Transport
from tests.harness import CHAT, eventually, run

LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=30.0)
TIMEOUT = httpx.Timeout(5.0, read=None)
"""As Pylon's client: no read timeout unless a test sets one."""


@dataclass
class Exchange:
    """One request as the scripted engine received it, and the means to answer it."""

    request: h11.Request
    body: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.request.headers if n == name), None)

    async def reply(
        self, body: bytes = b"", *, status: int = 200, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        framing = [("content-length", str(len(body)))]
        self.send(h11.Response(status_code=status, headers=[*framing, *headers]))
        self.send(h11.Data(data=body))
        self.send(h11.EndOfMessage())
        await self.writer.drain()

    def send(self, event: Any) -> None:
        self.writer.write(self.h11.send(event) or b"")

    async def write_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def peer_gone(self) -> bool:
        """The client closed or reset the connection."""
        return (
            self.reader.at_eof()
            or self.reader.exception() is not None
            or self.writer.transport.is_closing()
        )


Handler = Callable[[Exchange], Awaitable[None]]


@dataclass
class Engine:
    """HTTP/1.1 on loopback port 0; `handle` answers each request (or misbehaves)."""

    handle: Handler
    connections: int = 0
    requests: list[Exchange] = field(default_factory=list)
    gone: int = 0
    """Exchanges during which the client closed the connection."""
    closed: int = 0
    """Connections that ended, from either side."""
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Engine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        # Let handlers see the client's disconnect and return, rather than be cancelled.
        await eventually(lambda: self.closed == self.connections, within_s=2)
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while not writer.transport.is_closing():
                exchange = await _read_request(reader, writer)
                if exchange is None:
                    break
                self.requests.append(exchange)
                await self.handle(exchange)
                if exchange.peer_gone():
                    self.gone += 1
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.closed += 1


async def _read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> Exchange | None:
    """The next request on the connection (the client never pipelines), or None at EOF."""
    connection = h11.Connection(h11.SERVER)
    request, body = None, b""
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return Exchange(request, body, reader, writer, connection)
        else:
            return None


async def ok(exchange: Exchange) -> None:
    await exchange.reply(b"ok:" + exchange.body)


async def stall(exchange: Exchange) -> None:
    """Read the request, then say nothing until the client goes."""
    while not exchange.peer_gone():
        await asyncio.sleep(0.01)


async def endless_stream(exchange: Exchange) -> None:
    """An SSE stream that never ends: a token every 10 ms until the client goes."""
    exchange.send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream")]))
    while not exchange.peer_gone():
        exchange.send(h11.Data(data=b"data: token\n\n"))
        await asyncio.sleep(0.01)


def transport(**kwargs: Any) -> H11Transport:
    return H11Transport(limits=kwargs.pop("limits", LIMITS), **kwargs)


@contextlib.asynccontextmanager
async def client(
    h11_transport: H11Transport, *, timeout: httpx.Timeout = TIMEOUT
) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=h11_transport, timeout=timeout, trust_env=False) as http:
        yield http


class Trace:
    """Records the trace extension's events, as Pylon's AttemptTrace consumes them."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def __call__(self, event: str, info: Any) -> None:
        self.events.append(event)


# --- keep-alive and the pool ---------------------------------------------------------------


def test_sequential_requests_share_one_connection() -> None:
    async def scenario() -> None:
        async with Engine(ok) as engine, client(h11 := transport()) as http:
            for n in range(5):
                response = await http.post(engine.url + "/x", content=b"%d" % n)
                assert response.content == b"ok:%d" % n
            assert engine.connections == 1
            assert h11.stats().open == h11.stats().idle == 1

    run(scenario())


def test_sequential_requests_to_the_mock_engine_share_one_connection() -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=3))
        await engine.start()
        trace = Trace()
        body = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
        try:
            async with client(transport()) as http:
                for _ in range(3):
                    response = await http.post(
                        engine.url + CHAT, content=body, extensions={"trace": trace}
                    )
                    assert response.text.endswith("data: [DONE]\n\n")
            assert trace.events.count("connection.connect_tcp.started") == 1
        finally:
            await engine.close()

    run(scenario())


def test_requests_beyond_the_cap_wait_then_time_out() -> None:
    async def scenario() -> None:
        release = asyncio.Event()

        async def slow(exchange: Exchange) -> None:
            await release.wait()
            await exchange.reply(b"done")

        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        quick = httpx.Timeout(5.0, read=None, pool=0.1)
        async with Engine(slow) as engine, client(h11 := transport(limits=limits)) as http:
            first = asyncio.ensure_future(http.get(engine.url))
            assert await eventually(lambda: len(engine.requests) == 1, within_s=5)
            with pytest.raises(httpx.PoolTimeout) as timed_out:
                await http.get(engine.url, timeout=quick)
            assert isinstance(upstream_error_for(timed_out.value), UpstreamNotReady)
            queued = asyncio.ensure_future(http.get(engine.url))
            assert await eventually(lambda: h11.stats().waiting == 1, within_s=5)
            release.set()
            assert (await first).content == (await queued).content == b"done"
            assert engine.connections == 1, "the queued request should get the freed connection"

    run(scenario())


def test_queued_requests_are_served_in_arrival_order() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()

        async def gated(exchange: Exchange) -> None:
            await gate.wait()
            await exchange.reply(exchange.request.target)

        order: list[bytes] = []
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

        async def get(http: httpx.AsyncClient, path: str) -> None:
            order.append((await http.get(engine.url + path)).content)

        async with Engine(gated) as engine, client(h11 := transport(limits=limits)) as http:
            tasks = []
            for n in range(5):
                tasks.append(asyncio.ensure_future(get(http, f"/{n}")))
                assert await eventually(lambda n=n: h11.stats().waiting == n, within_s=5)
            gate.set()
            await asyncio.gather(*tasks)
        assert order == [b"/0", b"/1", b"/2", b"/3", b"/4"]

    run(scenario())


def test_a_queued_request_to_another_engine_gets_the_freed_slot() -> None:
    async def scenario() -> None:
        release = asyncio.Event()

        async def slow(exchange: Exchange) -> None:
            await release.wait()
            await exchange.reply(b"a")

        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with (
            Engine(slow) as a,
            Engine(ok) as b,
            client(h11 := transport(limits=limits)) as http,
        ):
            first = asyncio.ensure_future(http.get(a.url))
            assert await eventually(lambda: len(a.requests) == 1, within_s=5)
            other = asyncio.ensure_future(http.get(b.url))
            assert await eventually(lambda: h11.stats().waiting == 1, within_s=5)
            release.set()
            assert (await first).content == b"a"
            assert (await other).content == b"ok:"
            assert h11.stats().open == 1, "a's connection should have made way for b's"

    run(scenario())


def test_idle_connections_beyond_the_keepalive_limit_are_closed() -> None:
    async def scenario() -> None:
        together = asyncio.Barrier(3)

        async def gathered(exchange: Exchange) -> None:
            await together.wait()
            await exchange.reply(b"x")

        limits = httpx.Limits(max_connections=8, max_keepalive_connections=1)
        async with Engine(gathered) as engine, client(h11 := transport(limits=limits)) as http:
            await asyncio.gather(*(http.get(engine.url) for _ in range(3)))
            assert engine.connections == 3
            assert h11.stats().open == h11.stats().idle == 1

    run(scenario())


def test_expired_idle_connections_are_closed_not_reused() -> None:
    async def scenario() -> None:
        limits = httpx.Limits(max_connections=8, keepalive_expiry=0.05)
        async with Engine(ok) as engine, client(transport(limits=limits)) as http:
            await http.get(engine.url)
            await asyncio.sleep(0.1)
            await http.get(engine.url)
            assert engine.connections == 2

    run(scenario())


def test_a_connection_the_engine_closed_while_idle_is_not_reused() -> None:
    async def scenario() -> None:
        async def reply_then_close(exchange: Exchange) -> None:
            await exchange.reply(b"bye")  # no "connection: close": the client cannot know
            exchange.writer.close()

        trace = Trace()
        async with Engine(reply_then_close) as engine, client(h11 := transport()) as http:
            await http.get(engine.url)
            assert await eventually(lambda: engine.connections == 1, within_s=5)
            await asyncio.sleep(0.05)  # the FIN reaches the client's idle connection
            response = await http.get(engine.url, extensions={"trace": trace})
            assert response.content == b"bye"
            assert trace.events.count("connection.connect_tcp.started") == 1
            assert "http11.send_request_headers.failed" not in trace.events
            assert engine.connections == 2
            assert h11.stats().open <= 1

    run(scenario())


REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


@pytest.mark.parametrize("then_close", [True, False], ids=["then-close", "left-open"])
def test_bytes_the_engine_sends_to_an_idle_connection_retire_it(then_close: bool) -> None:
    """A 408 on idle timeout (as some servers send) is nobody's response: never the next one's."""

    async def scenario() -> None:
        idle, sent = asyncio.Event(), asyncio.Event()

        async def time_out_when_idle(exchange: Exchange) -> None:
            await exchange.reply(b"first" if engine.connections == 1 else b"second")
            if engine.connections == 1:
                await idle.wait()  # separately from the response: h11 would see it trailing
                await exchange.write_raw(REQUEST_TIMEOUT)
                if then_close:
                    exchange.writer.close()
                sent.set()

        trace = Trace()
        async with Engine(time_out_when_idle) as engine, client(h11 := transport()) as http:
            assert (await http.get(engine.url)).content == b"first"
            idle.set()
            await sent.wait()
            await asyncio.sleep(0.05)  # the 408 reaches the client's idle connection
            response = await http.get(engine.url, extensions={"trace": trace})
            assert (response.status_code, response.content) == (200, b"second")
            assert trace.events.count("connection.connect_tcp.started") == 1
            assert engine.connections == 2
            assert h11.stats().open == 1

    run(scenario())


def test_connection_close_from_the_engine_is_honoured() -> None:
    async def scenario() -> None:
        async def closing(exchange: Exchange) -> None:
            await exchange.reply(b"x", headers=[("connection", "close")])
            exchange.writer.close()

        async with Engine(closing) as engine, client(h11 := transport()) as http:
            for _ in range(2):
                await http.get(engine.url)
            assert engine.connections == 2
            assert h11.stats().open == 0

    run(scenario())


def test_closing_the_transport_closes_every_connection() -> None:
    async def scenario() -> None:
        async with Engine(endless_stream) as streaming, Engine(ok) as idle:
            h11 = transport()
            http = httpx.AsyncClient(transport=h11, timeout=TIMEOUT, trust_env=False)
            await http.get(idle.url)
            request = http.build_request("GET", streaming.url)
            response = await http.send(request, stream=True)
            assert h11.stats().open == 2
            await http.aclose()
            assert h11.stats().open == 0
            assert await eventually(lambda: streaming.gone == 1, within_s=5)
            await response.aclose()

    run(scenario())


# --- bodies ----------------------------------------------------------------------------------


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset : offset + size]
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("content_length", "framing"),
    [(False, b"transfer-encoding"), (True, b"content-length")],
    ids=["chunked", "content-length"],
)
def test_a_streamed_request_body_arrives_whole(content_length: bool, framing: bytes) -> None:
    body = bytes(range(256)) * 400

    async def scenario() -> None:
        headers = {"content-length": str(len(body))} if content_length else {}
        async with Engine(ok) as engine, client(transport()) as http:
            response = await http.post(engine.url, content=_pieces(body, 1000), headers=headers)
            assert response.content == b"ok:" + body
            assert engine.requests[0].header(framing) is not None

    run(scenario())


def test_a_buffered_request_body_goes_with_content_length() -> None:
    async def scenario() -> None:
        async with Engine(ok) as engine, client(transport()) as http:
            assert (await http.post(engine.url, content=b"hello")).content == b"ok:hello"
            assert engine.requests[0].header(b"content-length") == b"5"

    run(scenario())


@pytest.mark.parametrize("raw", [bytearray(b"abc"), memoryview(b"abc")], ids=type)
def test_a_bytes_like_request_stream_is_sent_as_is(raw: bytearray | memoryview) -> None:
    async def scenario() -> None:
        async with Engine(ok) as engine, transport() as h11:
            request = httpx.Request("POST", engine.url, content=b"...")
            request.stream = raw  # type: ignore[assignment]
            response = await h11.handle_async_request(request)
            assert await response.aread() == b"ok:abc"

    run(scenario())


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, offset = b"", 0
    for size in [*sizes, len(body)]:
        piece = body[offset : offset + max(size, 1)]
        if piece:
            out += b"%x\r\n%s\r\n" % (len(piece), piece)
        offset += len(piece)
    return out + b"0\r\n\r\n"


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.binary(max_size=3000),
    chunk_sizes=st.lists(st.integers(1, 700), max_size=8),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
    chunked=st.booleans(),
)
def test_any_split_of_the_response_into_writes_gives_the_same_body(
    body: bytes, chunk_sizes: list[int], cuts: list[int], chunked: bool
) -> None:
    """Framing and body as the engine wrote them, cut anywhere into separate socket writes."""
    if chunked:
        wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(
            body, chunk_sizes
        )
    else:
        wire = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body

    async def split_writes(exchange: Exchange) -> None:
        for piece in _split(wire, cuts):
            await exchange.write_raw(piece)
            await asyncio.sleep(0)

    async def scenario() -> None:
        async with Engine(split_writes) as engine, client(transport()) as http:
            for _ in range(2):  # and the connection is clean for the next exchange
                assert (await http.get(engine.url)).content == body
            assert engine.connections == 1

    run(scenario())


def test_sse_chunks_reach_the_reader_one_by_one() -> None:
    """The engine sends the next token only after the client saw the previous one."""

    async def scenario() -> None:
        seen = asyncio.Event()

        async def lockstep(exchange: Exchange) -> None:
            exchange.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
            for n in range(3):
                seen.clear()
                exchange.send(h11.Data(data=b"data: %d\n\n" % n))
                await exchange.writer.drain()
                await seen.wait()
            exchange.send(h11.EndOfMessage())

        async with Engine(lockstep) as engine, client(transport()) as http:
            async with asyncio.timeout(5), http.stream("GET", engine.url) as response:
                chunks = []
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
                    seen.set()
            assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]

    run(scenario())


def test_a_body_until_close_is_read_whole_and_the_connection_not_reused() -> None:
    async def scenario() -> None:
        async def http10(exchange: Exchange) -> None:
            await exchange.write_raw(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
            exchange.writer.close()

        async with Engine(http10) as engine, client(h11 := transport()) as http:
            assert (await http.get(engine.url)).content == b"until the end"
            assert h11.stats().open == 0

    run(scenario())


def test_closing_a_response_early_closes_the_connection() -> None:
    async def scenario() -> None:
        async with Engine(endless_stream) as engine, client(h11 := transport()) as http:
            async with http.stream("GET", engine.url) as response:
                async for _ in response.aiter_raw():
                    break
            assert h11.stats().open == 0
            assert await eventually(lambda: engine.gone == 1, within_s=5)

    run(scenario())


def test_https_engines_are_reached_over_tls(tmp_path: Path) -> None:
    cert, key = ensure_dev_certificate(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def scenario() -> None:
        server = await asyncio.start_server(
            lambda r, w: Engine(ok)._serve(r, w), "127.0.0.1", 0, ssl=server_tls
        )
        port = server.sockets[0].getsockname()[1]
        trusting = ssl.create_default_context(cafile=str(cert))
        try:
            async with client(transport(ssl_context=trusting)) as http:
                response = await http.post(f"https://127.0.0.1:{port}/", content=b"tls")
                assert response.content == b"ok:tls"
        finally:
            server.close()
            await server.wait_closed()

    run(scenario())


# --- failures ------------------------------------------------------------------------------


async def close_before_head(exchange: Exchange) -> None:
    exchange.writer.close()


async def close_mid_body(exchange: Exchange) -> None:
    await exchange.write_raw(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
    exchange.writer.close()


async def close_mid_chunked_body(exchange: Exchange) -> None:
    await exchange.write_raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
    exchange.writer.close()


async def reset_mid_body(exchange: Exchange) -> None:
    await exchange.write_raw(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nten bytes!")
    await asyncio.sleep(0.05)
    sock = exchange.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    exchange.writer.transport.abort()  # linger 0: an RST, not a FIN


async def not_http(exchange: Exchange) -> None:
    await exchange.write_raw(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")


async def never_connects(host: str, port: int, tls: ssl.SSLContext | None) -> Streams:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Failure:
    handler: Handler
    raised: type[httpx.TransportError]
    mapped: type[UpstreamError]
    read_timeout_s: float | None = None


FAILURES = {
    "closed before the head": Failure(close_before_head, httpx.RemoteProtocolError, UpstreamReset),
    "closed mid-body": Failure(close_mid_body, httpx.RemoteProtocolError, UpstreamReset),
    "closed mid-chunk": Failure(close_mid_chunked_body, httpx.RemoteProtocolError, UpstreamReset),
    "reset mid-body": Failure(reset_mid_body, httpx.ReadError, UpstreamReset),
    "not HTTP": Failure(not_http, httpx.RemoteProtocolError, UpstreamReset),
    "slow head": Failure(stall, httpx.ReadTimeout, UpstreamTimeout, read_timeout_s=0.1),
}


@pytest.mark.parametrize("failure", FAILURES.values(), ids=FAILURES.keys())
def test_engine_failures_raise_httpx_errors_pylon_maps(failure: Failure) -> None:
    async def scenario() -> None:
        async with Engine(failure.handler) as engine, client(h11 := transport()) as http:
            with pytest.raises(httpx.TransportError) as raised:
                await http.get(engine.url, timeout=httpx.Timeout(5.0, read=failure.read_timeout_s))
            assert type(raised.value) is failure.raised
            assert type(upstream_error_for(raised.value)) is failure.mapped
            assert h11.stats().open == 0

    run(scenario())


def test_a_refused_connection_is_a_connect_error() -> None:
    async def scenario() -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        async with client(h11 := transport()) as http:
            with pytest.raises(httpx.ConnectError) as refused:
                await http.get(f"http://127.0.0.1:{port}/")
            assert isinstance(upstream_error_for(refused.value), UpstreamUnreachable)
            assert h11.stats().open == 0

    run(scenario())


def test_a_slow_connect_is_a_connect_timeout() -> None:
    async def scenario() -> None:
        quick = httpx.Timeout(5.0, read=None, connect=0.05)
        async with client(h11 := transport(open_connection=never_connects), timeout=quick) as http:
            with pytest.raises(httpx.ConnectTimeout) as timed_out:
                await http.get("http://127.0.0.1:9/")
            assert isinstance(upstream_error_for(timed_out.value), UpstreamUnreachable)
            assert h11.stats().open == 0

    run(scenario())


def test_an_engine_that_stops_reading_is_a_write_timeout() -> None:
    async def scenario() -> None:
        stop = asyncio.Event()

        async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await stop.wait()
            writer.close()

        server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        quick = httpx.Timeout(5.0, read=None, write=0.2)
        try:
            async with client(h11 := transport(), timeout=quick) as http:
                with pytest.raises(httpx.WriteTimeout) as timed_out:
                    big = _pieces(bytes(1 << 20) * 64, 1 << 20)
                    await http.post(f"http://127.0.0.1:{port}/", content=big)
                assert isinstance(upstream_error_for(timed_out.value), UpstreamTimeout)
                assert h11.stats().open == 0
        finally:
            stop.set()
            server.close()
            await server.wait_closed()

    run(scenario())


TOO_LARGE = (
    b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 9\r\n\r\ntoo large"
)


@pytest.mark.parametrize("answer", [TOO_LARGE, b""], ids=["413", "no answer"])
def test_an_answer_before_the_upload_ends_is_the_response(answer: bytes) -> None:
    """The engine refuses a large body part-way and closes: the write fails, but a 413
    that arrived first is the response (as httpcore reads it); with none, the write error."""

    async def scenario() -> None:
        async def refuse_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(65536)  # the head and a little of the body
            writer.write(answer)
            await writer.drain()
            writer.close()  # with most of the body unread: the client's writes fail

        server = await asyncio.start_server(refuse_early, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        trace = Trace()
        try:
            async with client(h11 := transport()) as http:
                big = _pieces(bytes(1 << 20) * 64, 1 << 20)
                request = http.build_request("POST", url, content=big, extensions={"trace": trace})
                if answer:
                    response = await http.send(request)
                    assert (response.status_code, response.content) == (413, b"too large")
                else:
                    with pytest.raises(httpx.WriteError) as failed:
                        await http.send(request)
                    assert type(upstream_error_for(failed.value)) is UpstreamReset
                assert "http11.send_request_headers.failed" not in trace.events
                assert h11.stats().open == 0
        finally:
            server.close()
            await server.wait_closed()

    run(scenario())


def test_a_dead_connection_fails_the_head_write_and_says_so() -> None:
    """The retry rule's input: the trace reports a head that never left."""

    async def scenario() -> None:
        writers: list[asyncio.StreamWriter] = []

        async def remembering(host: str, port: int, tls: ssl.SSLContext | None) -> Streams:
            reader, writer = await open_tcp(host, port, tls)
            writers.append(writer)
            return reader, writer

        trace = Trace()
        async with Engine(ok) as engine, client(transport(open_connection=remembering)) as http:
            await http.get(engine.url)
            # Dies after the pool's liveness check and before the head is written:
            # the same loop iteration, so only the write itself can notice.
            raw = writers[0].get_extra_info("socket")
            with socket.fromfd(raw.fileno(), raw.family, raw.type) as alias:
                alias.shutdown(socket.SHUT_WR)  # the loop's own socket object may not offer it
            with pytest.raises(httpx.WriteError):
                await http.get(engine.url, extensions={"trace": trace})
            assert trace.events == ["http11.send_request_headers.failed"]

    run(scenario())


# --- cancellation ----------------------------------------------------------------------------


async def _stalled_body(started: asyncio.Event) -> AsyncIterator[bytes]:
    yield b"the first piece"
    started.set()
    await asyncio.Event().wait()


PHASES = ["waiting for the pool", "connecting", "sending the body", "awaiting the head", "reading"]


@pytest.mark.parametrize("phase", PHASES)
def test_cancellation_at_any_await_leaks_no_connection(phase: str) -> None:
    async def scenario() -> None:
        reached = asyncio.Event()
        trace = Trace()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        opener = never_connects if phase == "connecting" else open_tcp
        h11 = transport(limits=limits, open_connection=opener)
        handler = endless_stream if phase in ("reading", "waiting for the pool") else stall
        async with Engine(handler) as engine, client(h11) as http:
            blocker = None
            if phase == "waiting for the pool":
                blocker = await http.send(http.build_request("GET", engine.url), stream=True)

            async def exchange() -> None:
                content = _stalled_body(reached) if phase == "sending the body" else b""
                request = http.build_request(
                    "POST", engine.url, content=content, extensions={"trace": trace}
                )
                response = await http.send(request, stream=True)
                async for _ in response.aiter_raw():
                    reached.set()

            task = asyncio.ensure_future(exchange())
            checks = {
                "waiting for the pool": lambda: h11.stats().waiting == 1,
                "connecting": lambda: "connection.connect_tcp.started" in trace.events,
                "sending the body": reached.is_set,
                "awaiting the head": lambda: len(engine.requests) == 1,
                "reading": reached.is_set,
            }
            assert await eventually(checks[phase], within_s=5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            if blocker is not None:
                assert h11.stats().waiting == 0
                await blocker.aclose()
            assert h11.stats().open == 0
            assert await eventually(lambda: engine.closed == engine.connections, within_s=5)
            if phase != "connecting":
                # The pool still works: the slot the cancelled request held is free.
                engine.handle = ok
                assert (await http.get(engine.url)).content == b"ok:"

    run(scenario())
