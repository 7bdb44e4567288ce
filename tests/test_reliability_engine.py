"""Engine restarts behind a running Pylon: fail fast while down, recover without a restart.

The engine is killed under load and started again on the same port. No
request may hang; a request that fails before its response started gets a
502/503, and one cut after it gets a stream reset. Then traffic flows again
through the same Pylon and the same tunnel connection. The retry rule for
pooled connections (retry once only if the request head never left) is
checked with a network backend that breaks a reused connection on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import httpx
import orjson
import pytest

from backends.mock import MockEngine, MockEngineOptions
from pylon.config import UpstreamSettings
from pylon.errors import UpstreamReset
from pylon.forwarder import Forwarder, build_upstream_transport, upstream_limits
from pylon.readiness import ProbeResult
from pylon.upstream_connection import Streams, UpstreamReader
from pylon.upstream_transport import H11Transport
from tests.harness import CHAT, Stack, eventually, run, stack, tunnel_headers
from tunnel.client import H3Client
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

ENGINE = MockEngineOptions(tokens=20, token_delay_s=0.02)
STREAM_BODY = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
REQUEST_BOUND_S = 10.0
"""A request still unanswered after this long counts as hung (a bound, not a speed goal)."""
WORKERS = 8


@dataclass(frozen=True)
class Outcome:
    kind: str
    """ok, refused (502/503 answer), reset (after the head), or a failure kind."""
    status: int | None
    retry_safe: bool
    error_code: str | None
    phases: tuple[str, str]
    """Engine phase when the request started and when it ended."""


@dataclass
class Load:
    """Workers sending streamed completions in a loop, tagging each outcome with the phase."""

    client: H3Client
    phase: str = "up"
    outcomes: list[Outcome] = field(default_factory=list)
    stopping: bool = False

    async def worker(self, index: int) -> None:
        sent = 0
        while not self.stopping:
            started = self.phase
            kind, status, headers, body = await _one_request(self.client, f"w{index}-{sent}")
            code = orjson.loads(body)["error"]["code"] if kind == "refused" else None
            retry_safe = headers.get("x-pylon-retry-safe") == "true"
            self.outcomes.append(Outcome(kind, status, retry_safe, code, (started, self.phase)))
            sent += 1
            await asyncio.sleep(0.01)

    def count(self, kind: str, *, started: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind and o.phases[0] == started)


async def _one_request(client: H3Client, request_id: str) -> tuple[str, int, dict[str, str], bytes]:
    """(kind, status, headers, body) for one request; never raises, never hangs."""
    try:
        async with asyncio.timeout(REQUEST_BOUND_S):
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers(request_id), body=STREAM_BODY
            )
            headers = {name.decode(): value.decode() for name, value in response.headers}
            try:
                body = await response.read()
            except StreamAborted:
                return "reset", response.status, headers, b""
    except TimeoutError:
        return "hung", 0, {}, b""
    except StreamAborted:
        return "reset_before_head", 0, {}, b""
    if response.status in (502, 503):
        return "refused", response.status, headers, body
    complete = response.status == 200 and body.endswith(b"data: [DONE]\n\n")
    return ("ok" if complete else "unexpected"), response.status, headers, body


async def restarted(engine: MockEngine) -> MockEngine:
    """A new engine process on the port the old one had (the engine restarted)."""
    port = engine.port
    await engine.close()
    again = MockEngine(engine.options)
    await again.start("127.0.0.1", port)
    return again


def test_engine_kill_and_restart_under_load(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(ENGINE)
        await engine.start()
        port = engine.port
        try:
            async with stack(tmp_path, engine=None, upstream_url=engine.url) as s, s.client() as c:
                load = Load(c)
                workers = [asyncio.ensure_future(load.worker(i)) for i in range(WORKERS)]
                assert await eventually(lambda: load.count("ok", started="up") >= 8, within_s=10)
                await asyncio.sleep(0.2)  # mid-stream for most workers
                await engine.close()
                load.phase = "down"
                assert await s.pylon.probe.probe_once() is ProbeResult.UNREACHABLE
                assert not s.pylon.readiness.ready
                assert await eventually(
                    lambda: load.count("refused", started="down") >= 2 * WORKERS, within_s=10
                )
                load.phase = "restarting"
                engine = MockEngine(ENGINE)
                await engine.start("127.0.0.1", port)
                load.phase = "back"
                assert await s.pylon.probe.probe_once() is ProbeResult.HEALTHY
                assert s.pylon.readiness.ready
                assert await eventually(lambda: load.count("ok", started="back") >= 16, within_s=20)
                load.stopping = True
                await asyncio.gather(*workers)
                _check_outcomes(load)
                resets = sum(1 for o in load.outcomes if o.kind == "reset")
                assert cancellations(s, "engine") == resets
                assert cancellations(s, "gateway") == 0
        finally:
            await engine.close()

    run(scenario(), timeout_s=90)


def cancellations(s: Stack, by: str) -> float:
    return s.metric("pylon_cancellations_total", backend="passthrough", by=by)


def _check_outcomes(load: Load) -> None:
    kinds = Counter(o.kind for o in load.outcomes)
    print(f"outcomes: {dict(kinds)}")
    print(Counter((o.kind, o.status, o.error_code, o.retry_safe, o.phases) for o in load.outcomes))
    assert set(kinds) <= {"ok", "refused", "reset"}, kinds
    for outcome in load.outcomes:
        if outcome.kind == "refused":
            assert outcome.status in (502, 503), outcome
        if outcome.phases == ("down", "down"):
            # The engine was gone for the whole request: refused at once, retry-safe.
            assert outcome.kind == "refused" and outcome.status == 502, outcome
            assert outcome.retry_safe and outcome.error_code == "upstream_unreachable", outcome


def test_engine_restart_between_requests_needs_no_pylon_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pooled connection to the old engine is dead; the next request still succeeds."""

    async def scenario() -> None:
        engine = MockEngine(ENGINE)
        await engine.start()
        try:
            async with stack(tmp_path, engine=None, upstream_url=engine.url) as s, s.client() as c:
                for round_ in range(3):
                    kind, status, _, _ = await _one_request(c, f"between-{round_}")
                    assert (kind, status) == ("ok", 200)
                    engine = await restarted(engine)
        finally:
            await engine.close()

    with caplog.at_level(logging.WARNING, logger="pylon.forwarder"):
        run(scenario())
    # The transport drops an idle connection the old engine closed before
    # reusing it, so no retry was needed here.
    assert not [r for r in caplog.records if r.name == "pylon.forwarder"]


def test_not_ready_engine_still_gets_requests(tmp_path: Path) -> None:
    """Pylon does not gate traffic on the probe: a stale or slow probe must not cause 503s."""

    async def scenario() -> None:
        async with stack(tmp_path, engine=ENGINE) as s, s.client() as client:
            assert s.engine is not None
            s.engine.set_behaviour(health_status=503)
            assert await s.pylon.probe.probe_once() is ProbeResult.UNHEALTHY
            assert not s.pylon.readiness.ready
            kind, status, _, _ = await _one_request(client, "not-ready")
            assert (kind, status) == ("ok", 200)

    run(scenario())


# --- the retry rule, with a network backend that breaks a reused connection ----------------


class _BreakingStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, backend: BreakingBackend) -> None:
        self._inner = inner
        self._backend = backend

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._backend.take("read"):
            raise httpcore.ReadError("connection reset by peer (injected)")
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._backend.take("write"):
            await self._inner.aclose()  # the engine is gone: reads fail too
            raise httpcore.WriteError("broken pipe (injected)")
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _BreakingReader(UpstreamReader):
    def __init__(self, backend: BreakingBackend) -> None:
        super().__init__()
        self._backend = backend

    async def read(self, n: int = -1) -> bytes:
        if self._backend.take("read"):
            raise ConnectionResetError("connection reset by peer (injected)")
        return await super().read(n)


class _BreakingWriter(asyncio.StreamWriter):
    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: asyncio.StreamReaderProtocol,
        reader: asyncio.StreamReader,
        backend: BreakingBackend,
    ) -> None:
        super().__init__(transport, protocol, reader, asyncio.get_running_loop())
        self._backend = backend

    def write(self, data: Any) -> None:
        if self._backend.take("write"):
            self.transport.abort()  # the engine is gone: the write is lost, reads fail too
        super().write(data)


class BreakingBackend(httpcore.AsyncNetworkBackend):
    """Real TCP; once armed, the next read or write on any connection fails once.

    Both transports' network edges: httpcore's network backend, and the h11
    transport's `open_connection`.
    """

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()
        self.connections = 0
        self.armed: str | None = None

    def take(self, operation: str) -> bool:
        if self.armed != operation:
            return False
        self.armed = None
        return True

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        inner = await self._inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        self.connections += 1
        return _BreakingStream(inner, self)

    async def open_connection(self, host: str, port: int, tls: ssl.SSLContext | None) -> Streams:
        reader = _BreakingReader(self)
        protocol = asyncio.StreamReaderProtocol(reader)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(lambda: protocol, host, port, ssl=tls)
        self.connections += 1
        return reader, _BreakingWriter(transport, protocol, reader, self)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def _body_in_pieces() -> AsyncIterator[bytes]:
    """A streamed request body, as the service forwards one it does not rewrite."""
    for offset in range(0, len(STREAM_BODY), 16):
        yield STREAM_BODY[offset : offset + 16]


async def _forward(forwarder: Forwarder, request_id: str, *, streamed: bool = False) -> bytes:
    headers = ((b"x-request-id", request_id.encode()), (b"content-type", b"application/json"))
    content = _body_in_pieces() if streamed else STREAM_BODY
    async with forwarder.exchange(
        method="POST", path=CHAT, headers=headers, content=content, request_id=request_id
    ) as upstream:
        return b"".join([chunk async for chunk in upstream.chunks()])


@contextlib.asynccontextmanager
async def breaking_forwarder(
    transport: str,
) -> AsyncIterator[tuple[Forwarder, BreakingBackend, MockEngine]]:
    engine = MockEngine(ENGINE)
    await engine.start()
    settings = UpstreamSettings(url=engine.url, transport=transport)
    backend = BreakingBackend()
    upstream: httpx.AsyncBaseTransport
    if transport == "h11":
        upstream = H11Transport(
            limits=upstream_limits(settings), open_connection=backend.open_connection
        )
    else:
        upstream = build_upstream_transport(settings)
        # httpx has no public hook for httpcore's network backend; tests only.
        upstream._pool._network_backend = backend  # type: ignore[attr-defined]
    try:
        yield Forwarder(upstream, settings), backend, engine
    finally:
        await upstream.aclose()
        await engine.close()


def _seen(engine: MockEngine, request_id: str) -> int:
    return sum(1 for r in engine.snapshot()["requests"] if r["x_request_id"] == request_id)


TRANSPORTS = pytest.mark.parametrize("transport", ["h11", "httpcore"])


@TRANSPORTS
@pytest.mark.parametrize("streamed", [False, True], ids=["buffered-body", "streamed-body"])
def test_reused_connection_dead_before_the_head_is_retried_once(
    transport: str, streamed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with breaking_forwarder(transport) as (forwarder, backend, engine):
            assert (await _forward(forwarder, "first")).endswith(b"[DONE]\n\n")
            backend.armed = "write"  # the pooled connection dies before the next head
            second = await _forward(forwarder, "second", streamed=streamed)
            assert second.endswith(b"[DONE]\n\n")
            (record,) = [r for r in engine.snapshot()["requests"] if r["x_request_id"] == "second"]
            assert record["body_sha256"] == hashlib.sha256(STREAM_BODY).hexdigest()
            assert backend.connections == 2, "the retry should have opened a fresh connection"

    with caplog.at_level(logging.WARNING, logger="pylon.forwarder"):
        run(scenario())
    assert [r.message for r in caplog.records if r.name == "pylon.forwarder"] == [
        "engine closed a pooled connection before the request; retrying once"
    ]


@TRANSPORTS
def test_failure_after_the_head_went_out_is_never_retried(transport: str) -> None:
    async def scenario() -> None:
        async with breaking_forwarder(transport) as (forwarder, backend, engine):
            await _forward(forwarder, "first")
            backend.armed = "read"  # the head and body were written: the engine has the request
            with pytest.raises(UpstreamReset) as failed:
                await _forward(forwarder, "second")
            assert not failed.value.retry_safe
            assert await eventually(lambda: _seen(engine, "second") == 1, within_s=5)
            assert backend.connections == 1, "a request the engine may have seen was sent again"

    run(scenario())
