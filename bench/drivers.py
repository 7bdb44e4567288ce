"""Request drivers: one request over HTTP/3 (aioquic, like the gateway) or HTTP/1.1 (httpx).

Strategy: both drivers turn a `RequestSpec` into a `Record` the same way: a
`StreamObserver` is fed every body chunk with its arrival time, and the
request is bounded by an absolute deadline; a request that misses it is
abandoned the way a real client would (HTTP/3 stream reset, TCP connection
closed) and recorded as "timeout". The HTTP/3 driver spreads requests over
several QUIC connections so that no connection needs more concurrent streams
than servers grant by default (quic-go, inside Caddy, grants 100).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import httpx

from bench.h3client import TimedH3Client, open_timed_client
from bench.sse import StreamObserver
from bench.stats import Record
from bench.workloads import RequestSpec
from tunnel.types import StreamAborted

BODY_CHUNK_BYTES = 64 * 1024
"""Request bodies go out in DATA frames of this size, as `tunnel.client` sends them."""


@dataclass(frozen=True)
class Target:
    """Where the load goes: "h3" (Pylon, Caddy) or "h1" (the engine directly)."""

    protocol: str
    host: str
    port: int

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


class Driver(Protocol):
    async def send(self, spec: RequestSpec, request_id: str, *, deadline: float) -> Record: ...


def _request_headers(spec: RequestSpec, request_id: str) -> list[tuple[str, str]]:
    headers = [("x-request-id", request_id), *spec.headers]
    if spec.body:
        # Caddy 2.6 forwards an HTTP/3 body without a declared length as empty.
        headers.append(("content-length", str(len(spec.body))))
    return headers


def _record(
    spec: RequestSpec,
    request_id: str,
    observer: StreamObserver,
    *,
    status: int | None,
    end_s: float | None,
    error: str | None,
) -> Record:
    return Record(
        label=spec.label,
        request_id=request_id,
        start_s=observer.start_s,
        status=status,
        ttfb_s=observer.ttfb_s,
        ttft_s=observer.ttft_s,
        total_s=None if end_s is None else end_s - observer.start_s,
        bytes=observer.bytes,
        events=observer.events,
        expected_events=spec.expected_events,
        gaps_s=tuple(observer.gaps_s),
        error=error,
    )


class H3Driver:
    def __init__(self, clients: list[TimedH3Client], authority: str) -> None:
        self._clients = clients
        self._authority = authority
        self._next = 0

    def _client(self) -> TimedH3Client:
        self._next = (self._next + 1) % len(self._clients)
        return self._clients[self._next]

    async def send(self, spec: RequestSpec, request_id: str, *, deadline: float) -> Record:
        client = self._client()
        head = [
            (b":method", spec.method.encode()),
            (b":scheme", b"https"),
            (b":authority", self._authority.encode()),
            (b":path", spec.path.encode()),
            *((k.encode(), v.encode()) for k, v in _request_headers(spec, request_id)),
        ]
        observer = StreamObserver(time.monotonic())
        status: int | None = None
        stream_id = client.open_request_with_body(
            tuple(head), spec.body, chunk_size=BODY_CHUNK_BYTES
        )
        try:
            async with asyncio.timeout_at(deadline):
                await client.send_rest_paced(stream_id, spec.body, chunk_size=BODY_CHUNK_BYTES)
                response = await client.response(stream_id)
                status = response.status
                async for chunk in response.chunks():
                    observer.feed(chunk, client.arrival(stream_id))
        except TimeoutError:
            client.reset_stream(stream_id)
            return _record(spec, request_id, observer, status=status, end_s=None, error="timeout")
        except StreamAborted as exc:
            error = f"reset:{exc.error_code:#x}"
            return _record(spec, request_id, observer, status=status, end_s=None, error=error)
        return _record(
            spec, request_id, observer, status=status, end_s=time.monotonic(), error=None
        )


class H1Driver:
    """One single-connection httpx client per request in flight, reused from a free list.

    httpcore's pool rescans every pooled connection (with a readability poll
    on each) whenever a request starts or ends, so one shared pool of N
    connections costs O(N) per request and the client, not the server,
    becomes the bottleneck at a few hundred concurrent streams.
    """

    def __init__(self, base_url: str) -> None:
        self._base_url = base_url
        self._tls = ssl.create_default_context()
        """Shared: each client would otherwise load the CA bundle (~10 ms of CPU)."""
        self._idle: list[httpx.AsyncClient] = []
        self.clients: list[httpx.AsyncClient] = []

    def _take(self) -> httpx.AsyncClient:
        if self._idle:
            return self._idle.pop()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        client = httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(None), trust_env=False, verify=self._tls
        )
        self.clients.append(client)
        return client

    async def send(self, spec: RequestSpec, request_id: str, *, deadline: float) -> Record:
        client = self._take()
        try:
            return await self._send(client, spec, request_id, deadline=deadline)
        finally:
            self._idle.append(client)

    async def _send(
        self, client: httpx.AsyncClient, spec: RequestSpec, request_id: str, *, deadline: float
    ) -> Record:
        observer = StreamObserver(time.monotonic())
        status: int | None = None
        request = client.build_request(
            spec.method,
            self._base_url + spec.path,
            headers=_request_headers(spec, request_id),
            content=spec.body or None,
        )
        try:
            async with asyncio.timeout_at(deadline):
                response = await client.send(request, stream=True)
                try:
                    status = response.status_code
                    async for chunk in response.aiter_raw():
                        observer.feed(chunk, time.monotonic())
                finally:
                    await response.aclose()
        except TimeoutError:
            return _record(spec, request_id, observer, status=status, end_s=None, error="timeout")
        except httpx.HTTPError as exc:
            error = type(exc).__name__
            return _record(spec, request_id, observer, status=status, end_s=None, error=error)
        end = time.monotonic()
        return _record(spec, request_id, observer, status=status, end_s=end, error=None)


@contextlib.asynccontextmanager
async def open_driver(
    target: Target, *, connections: int, concurrency: int
) -> AsyncIterator[Driver]:
    """Connected clients for one worker: `connections` QUIC connections, or an httpx pool."""
    if target.protocol == "h1":
        driver = H1Driver(f"http://{target.host}:{target.port}")
        try:
            yield driver
        finally:
            await asyncio.gather(*(c.aclose() for c in driver.clients), return_exceptions=True)
        return
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(open_timed_client(target.host, target.port))
            for _ in range(connections)
        ]
        yield H3Driver(clients, target.authority)
