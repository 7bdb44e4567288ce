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
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import httpx

from bench.sse import StreamObserver
from bench.stats import Record
from bench.workloads import RequestSpec
from tunnel.client import H3Client, client_configuration, open_client
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
    def __init__(self, clients: list[H3Client], authority: str) -> None:
        self._clients = clients
        self._authority = authority
        self._next = 0

    def _client(self) -> H3Client:
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
        stream_id = client.open_request(tuple(head), end=not spec.body)
        try:
            async with asyncio.timeout_at(deadline):
                await _send_body(client, stream_id, spec.body)
                response = await client.response(stream_id)
                status = response.status
                async for chunk in response.chunks():
                    observer.feed(chunk, time.monotonic())
        except TimeoutError:
            client.reset_stream(stream_id)
            return _record(spec, request_id, observer, status=status, end_s=None, error="timeout")
        except StreamAborted as exc:
            error = f"reset:{exc.error_code:#x}"
            return _record(spec, request_id, observer, status=status, end_s=None, error=error)
        return _record(
            spec, request_id, observer, status=status, end_s=time.monotonic(), error=None
        )


async def _send_body(client: H3Client, stream_id: int, body: bytes) -> None:
    view = memoryview(body)
    for offset in range(0, len(body), BODY_CHUNK_BYTES):
        end = offset + BODY_CHUNK_BYTES >= len(body)
        client.send_body(stream_id, bytes(view[offset : offset + BODY_CHUNK_BYTES]), end=end)
        await asyncio.sleep(0)


class H1Driver:
    def __init__(self, client: httpx.AsyncClient, base_url: str) -> None:
        self._client = client
        self._base_url = base_url

    async def send(self, spec: RequestSpec, request_id: str, *, deadline: float) -> Record:
        observer = StreamObserver(time.monotonic())
        status: int | None = None
        request = self._client.build_request(
            spec.method,
            self._base_url + spec.path,
            headers=_request_headers(spec, request_id),
            content=spec.body or None,
        )
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._client.send(request, stream=True)
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
        return _record(
            spec, request_id, observer, status=status, end_s=time.monotonic(), error=None
        )


@contextlib.asynccontextmanager
async def open_driver(
    target: Target, *, connections: int, concurrency: int
) -> AsyncIterator[Driver]:
    """Connected clients for one worker: `connections` QUIC connections, or an httpx pool."""
    if target.protocol == "h1":
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(None), trust_env=False
        ) as client:
            yield H1Driver(client, f"http://{target.host}:{target.port}")
        return
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(connections):
            configuration = client_configuration(verify=False)
            clients.append(
                await stack.enter_async_context(
                    open_client(target.host, target.port, configuration=configuration)
                )
            )
        yield H3Driver(clients, target.authority)
