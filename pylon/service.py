"""The tunnel request handler: plan, read the body, forward, stream back, account.

This is the I/O shell around the pure pipeline. Errors before the response
head are answered as OpenAI-shaped JSON; errors after it reset the stream, so
a truncated answer never looks complete. A gateway reset cancels this task,
which closes the upstream response and so stops the engine's generation.
Every abnormal end is classified by who caused it (`CANCELLED_BY`), for the
access log and `pylon_cancellations_total{by}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from aioquic.h3.connection import ErrorCode

from backends.base import BackendAdapter
from pylon.auth import Admission
from pylon.errors import (
    BodyIdleTimeout,
    BodyTooLarge,
    Draining,
    PylonError,
    RequestRejected,
    TooEarly,
    UpstreamError,
    UpstreamTimeout,
)
from pylon.forwarder import Forwarder
from pylon.logs import AccessLog
from pylon.metrics import Metrics
from pylon.pipeline import (
    PipelineOptions,
    RequestPlan,
    classify_route,
    plan_request,
    sanitize_body,
)
from pylon.tracing import Tracing
from pylon.tunnel_headers import REQUEST_ID
from tunnel.stream import TunnelStream
from tunnel.types import StreamAborted

logger = logging.getLogger("pylon.access")

REPLAY_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""RFC 9110 §9.2.2 idempotent-and-safe methods: the only ones served from 0-RTT data."""
debug_logger = logging.getLogger("pylon.priority")

CANCELLED_BY: tuple[tuple[type[PylonError], str], ...] = (
    # Subclasses before their bases. A gateway reset or a dropped connection is
    # "gateway"; a drain whose grace ran out cuts streams as "drain".
    (UpstreamTimeout, "timeout"),
    (Draining, "drain"),
    (RequestRejected, "limit"),
    (UpstreamError, "engine"),
)
"""Who ended a stream whose response had already started, by the error that ended it."""


def cancelled_by(error: PylonError) -> str:
    for error_type, label in CANCELLED_BY:
        if isinstance(error, error_type):
            return label
    return "engine"


@dataclass
class Exchange:
    """What happened to one request, for the access log and metrics."""

    started: float
    route: str = "unrouted"
    request_id: str | None = None
    status: int | None = None
    emitted_priority: int | None = None
    ttfb_s: float | None = None
    error: str | None = None
    cancelled_by: str | None = None
    cut_by: str | None = None
    """Set when Pylon itself cancels the request (`TunnelService.cut_in_flight`)."""
    request_bytes: int = 0
    span: Any = None
    """The tunnel request's OpenTelemetry span, when tracing is on."""

    def first_byte(self) -> None:
        """The engine's first body bytes arrived."""
        self.ttfb_s = asyncio.get_running_loop().time() - self.started


@dataclass(frozen=True)
class ServiceOptions:
    pipeline: PipelineOptions
    max_body_bytes: int
    total_timeout_s: float | None
    admission: Admission = field(default_factory=Admission)
    """Concurrency limits, header size and the bearer token, checked before planning."""
    body_idle_timeout_s: float | None = None
    """Longest wait for the next request body bytes (408, or a reset once forwarding)."""


class TunnelService:
    def __init__(
        self,
        *,
        adapter: BackendAdapter,
        forwarder: Forwarder,
        options: ServiceOptions,
        metrics: Metrics,
        tracing: Tracing | None = None,
    ) -> None:
        self._tracing = tracing
        self._adapter = adapter
        self._forwarder = forwarder
        self._options = options
        self._metrics = metrics
        self.draining = False
        """Set when shutdown starts: new requests get 503 with the retry-safe marker."""
        self._in_flight: dict[asyncio.Task[Any], Exchange] = {}
        self._access_log = AccessLog(logger, "request finished")

    def cut_in_flight(self, *, by: str) -> int:
        """Cancel every request still running, recording `by` as who ended it.

        A drain whose grace period is over calls this before the connections
        close, so the cut streams are counted as "drain", not as gateway resets.
        """
        for task, exchange in self._in_flight.items():
            exchange.cut_by = by
            task.cancel()
        return len(self._in_flight)

    async def __call__(self, stream: TunnelStream) -> None:
        if self._tracing is None:  # no tracing cost at all when it is off
            await self._handle(stream, span=None)
            return
        head = stream.head
        with self._tracing.tunnel_span(
            method=head.method, path=head.path, headers=head.headers
        ) as span:
            await self._handle(stream, span=span)

    def _upstream_span(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if self._tracing is None else self._tracing.upstream_span()

    async def _handle(self, stream: TunnelStream, *, span: Any) -> None:
        loop = asyncio.get_running_loop()
        exchange = Exchange(started=loop.time(), span=span)
        task = asyncio.current_task()
        assert task is not None
        self._in_flight[task] = exchange
        try:
            if self.draining:
                raise Draining("Pylon is draining; retry on another node")
            if stream.early and stream.head.method not in REPLAY_SAFE_METHODS:
                raise TooEarly("sent as 0-RTT early data, which can be replayed; resend it")
            self._options.admission.check(stream)
            deadline_s = self._options.total_timeout_s
            if deadline_s is None:  # the default: no timer, and no context to enter for it
                await self._serve(stream, exchange)
            else:
                async with asyncio.timeout(deadline_s):
                    await self._serve(stream, exchange)
        except TimeoutError:
            self._fail(stream, exchange, UpstreamTimeout("engine: total deadline exceeded"))
        except PylonError as error:
            self._fail(stream, exchange, error)
        except (asyncio.CancelledError, StreamAborted):
            exchange.cancelled_by = exchange.cut_by or "gateway"
            raise
        finally:
            self._in_flight.pop(task, None)
            self._account(stream, exchange, duration_s=loop.time() - exchange.started)

    async def _serve(self, stream: TunnelStream, exchange: Exchange) -> None:
        options = self._options.pipeline
        route_class = classify_route(self._adapter, stream.head, options.extra_health_paths)
        exchange.route = route_class.value
        plan = plan_request(
            stream.head, adapter=self._adapter, options=options, route_class=route_class
        )
        exchange.request_id = plan.tunnel.request_id
        self._metrics.inputs_stripped("header", plan.stripped_headers)
        content = await self._request_content(stream, plan, exchange)
        self._note_priority(plan, exchange)
        with self._upstream_span():
            await self._forward(stream, plan, exchange, content)

    async def _forward(
        self,
        stream: TunnelStream,
        plan: RequestPlan,
        exchange: Exchange,
        content: bytes | AsyncIterator[bytes],
    ) -> None:
        async with self._forwarder.exchange(
            method=stream.head.method,
            path=stream.head.path,
            headers=plan.headers,
            content=content,
            request_id=plan.tunnel.request_id,
        ) as upstream:
            stream.send_head(upstream.status, upstream.headers)
            exchange.status = upstream.status
            await upstream.relay_to(stream, on_first_chunk=exchange.first_byte)

    async def _request_content(
        self, stream: TunnelStream, plan: RequestPlan, exchange: Exchange
    ) -> bytes | AsyncIterator[bytes]:
        limit = self._options.max_body_bytes
        declared = _declared_length(stream)
        if declared is not None and declared > limit:
            raise BodyTooLarge(f"request body of {declared} bytes exceeds {limit}")
        if plan.rewrite_body:
            raw = await _read_bounded(stream, limit, self._options.body_idle_timeout_s)
            body, stripped = sanitize_body(self._adapter, plan, raw)
            self._metrics.inputs_stripped("body", stripped)
            exchange.request_bytes = len(body)
            return body
        if stream.received_all:
            # All in already (most requests): one write with the head, not a chunk stream.
            body = await _read_bounded(stream, limit, self._options.body_idle_timeout_s)
            exchange.request_bytes = len(body)
            return body
        return self._stream_bounded(stream, exchange, limit)

    async def _stream_bounded(
        self, stream: TunnelStream, exchange: Exchange, limit: int
    ) -> AsyncIterator[bytes]:
        idle_s = self._options.body_idle_timeout_s
        async for chunk in _body_chunks(stream, idle_s, upstream_started=True):
            exchange.request_bytes += len(chunk)
            if exchange.request_bytes > limit:
                raise BodyTooLarge(f"request body exceeds {limit} bytes")
            yield chunk

    def _note_priority(self, plan: RequestPlan, exchange: Exchange) -> None:
        exchange.emitted_priority = plan.derived.emitted_priority
        self._metrics.priority_derived(plan.derivation, plan.derived.emitted_priority)
        if plan.derived.emitted_priority is not None:
            debug_logger.debug(
                "engine priority %d emitted for request %s (%s)",
                plan.derived.emitted_priority,
                plan.tunnel.request_id,
                plan.derivation.value,
            )

    def _fail(self, stream: TunnelStream, exchange: Exchange, error: PylonError) -> None:
        exchange.error = error.code
        if isinstance(error, RequestRejected):
            self._metrics.request_rejected(error.code)
        elif isinstance(error, UpstreamError):
            self._metrics.upstream_failed(error.kind)
        reset_code = _reset_code(stream, error)
        if reset_code is not None:
            exchange.cancelled_by = cancelled_by(error)
            exchange.status = None
            stream.reset(reset_code)
            return
        exchange.status = error.status
        headers = list(error.headers())
        if exchange.request_id is not None:
            headers.append((REQUEST_ID, exchange.request_id.encode("ascii")))
        body = error.body()
        headers.append((b"content-length", str(len(body)).encode()))
        stream.send_complete(error.status, tuple(headers), body)

    def _account(self, stream: TunnelStream, exchange: Exchange, *, duration_s: float) -> None:
        if exchange.span is not None:
            _annotate_span(exchange.span, exchange, backend=self._adapter.name)
        if exchange.cancelled_by is not None:
            self._metrics.request_cancelled(exchange.cancelled_by)
        self._metrics.request_finished(
            route=exchange.route,
            status=exchange.status if exchange.cancelled_by is None else None,
            duration_s=duration_s,
            ttfb_s=exchange.ttfb_s,
            request_bytes=exchange.request_bytes,
            response_bytes=stream.body_bytes_sent,
        )
        self._access_log.write(
            {
                "request_id": exchange.request_id,
                "backend": self._adapter.name,
                "route": exchange.route,
                "status": exchange.status,
                "emitted_priority": exchange.emitted_priority,
                "ttfb_s": exchange.ttfb_s,
                "duration_s": round(duration_s, 6),
                "request_bytes": exchange.request_bytes,
                "response_bytes": stream.body_bytes_sent,
                "error": exchange.error,
                "cancelled_by": exchange.cancelled_by,
            }
        )


def _declared_length(stream: TunnelStream) -> int | None:
    for name, value in stream.head.headers:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


async def _body_chunks(
    stream: TunnelStream, idle_s: float | None, *, upstream_started: bool
) -> AsyncIterator[bytes]:
    """The request body; BodyIdleTimeout once the gateway sends nothing for `idle_s`."""
    while True:
        try:
            chunk = await stream.receive(idle_s)
        except TimeoutError:
            message = f"no request body bytes for {idle_s} s"
            raise BodyIdleTimeout(message, upstream_started=upstream_started) from None
        if not chunk:
            return
        yield chunk


def _reset_code(stream: TunnelStream, error: PylonError) -> int | None:
    """The reset for a stream that must not get a clean error answer, else None."""
    if isinstance(error, BodyIdleTimeout) and error.upstream_started:
        return ErrorCode.H3_REQUEST_INCOMPLETE  # the engine saw part of the request
    return ErrorCode.H3_INTERNAL_ERROR if stream.head_sent else None


async def _read_bounded(stream: TunnelStream, limit: int, idle_s: float | None) -> bytes:
    if stream.received_all:  # all in already: no chunk loop and no timer per chunk
        body = stream.take_received()
        if len(body) > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        return body
    chunks: list[bytes] = []
    size = 0
    async for chunk in _body_chunks(stream, idle_s, upstream_started=False):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _annotate_span(span: Any, exchange: Exchange, *, backend: str) -> None:
    attributes = {
        "pylon.request_id": exchange.request_id,
        "pylon.backend": backend,
        "pylon.route": exchange.route,
        "pylon.priority.emitted": exchange.emitted_priority,
        "http.response.status_code": exchange.status,
        "pylon.error": exchange.error,
        "pylon.cancelled_by": exchange.cancelled_by,
    }
    span.set_attributes({key: value for key, value in attributes.items() if value is not None})
