"""Request handling of the mock engine, independent of the socket layer.

Strategy: the server hands over one complete `IncomingRequest` and a
`Responder` (the only way out to the wire); the dispatcher classifies the
route, records the request, applies the flavour's rules, waits for a slot
and answers. Cancellation of the handling task is how the server reports a
client disconnect; it is recorded as an abort unless the response was
already complete.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from backends.mock import responses
from backends.mock.control import ControlPlane
from backends.mock.flavours import FLAVOURS, Resolution
from backends.mock.inputs import HeaderList, RejectedError, first_header
from backends.mock.options import Behaviour, MockEngineOptions
from backends.mock.queue import ORDERING, Waiting
from backends.mock.recorder import RequestRecord
from backends.mock.routes import RouteKind, classify

JSON_HEADERS = [("content-type", "application/json")]
SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]


@dataclass(frozen=True)
class IncomingRequest:
    """One complete HTTP request as read off the wire."""

    method: str
    path: str
    """Path without the query string."""
    headers: HeaderList
    body: bytes


class Responder(Protocol):
    """How a handler writes its answer; implemented over h11 by the server."""

    @property
    def completed(self) -> bool: ...
    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None: ...
    async def start(self, status: int, headers: list[tuple[str, str]]) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def finish(self) -> None: ...
    def crash(self) -> None: ...


@dataclass(frozen=True)
class Call:
    """One request being handled: what arrived, its JSON object body, its record."""

    request: IncomingRequest
    body: dict[str, Any] | None
    """The body parsed once (None when it is not a JSON object)."""
    record: RequestRecord


Handler = Callable[[Call, Responder], Awaitable[None]]


class Dispatcher:
    """Routes requests and holds the engine's state (behaviour, queue, records)."""

    def __init__(self, options: MockEngineOptions, clock: Callable[[], float]) -> None:
        self.options = options
        self.flavour = FLAVOURS[options.engine]
        self.control = ControlPlane(options)
        self._clock = clock
        self._ids = itertools.count(1)
        self._handlers: dict[RouteKind, Handler] = {
            RouteKind.ADMIN: self._admin,
            RouteKind.HEALTH: self._health,
            RouteKind.MODELS: self._models,
            RouteKind.INFERENCE: self._inference,
            RouteKind.WRONG_METHOD: self._wrong_method,
            RouteKind.NOT_FOUND: self._not_found,
        }

    async def handle(self, request: IncomingRequest, out: Responder) -> None:
        kind = classify(self.flavour, request.method, request.path)
        if kind is RouteKind.CONTROL:
            status, answer = self.control.handle(request.method, request.body)
            await out.send(status, JSON_HEADERS, responses.dumps(answer))
            return
        body = parse_object(request.body) if request.body else None
        record = self._record(request, body or {})
        self.control.recorder.arrived(record)
        await self._handlers[kind](Call(request, body, record), out)

    def _record(self, request: IncomingRequest, body: Mapping[str, Any]) -> RequestRecord:
        x_request_id = first_header(request.headers, "x-request-id")
        model = body.get("model")
        return RequestRecord(
            method=request.method,
            path=request.path,
            model=model if isinstance(model, str) else "",
            request_id=x_request_id or f"mock-{next(self._ids)}",
            x_request_id=x_request_id,
            headers=[[name, value] for name, value in request.headers],
            body_bytes=len(request.body),
            body_sha256=hashlib.sha256(request.body).hexdigest(),
            arrival_s=self._clock(),
        )

    async def _reply(
        self, out: Responder, record: RequestRecord, status: int, body: Mapping[str, Any]
    ) -> None:
        record.status = status
        await out.send(status, self._headers(record, JSON_HEADERS), responses.dumps(body))
        record.finish_s = self._clock()

    async def _error(self, out: Responder, record: RequestRecord, status: int, msg: str) -> None:
        await self._reply(out, record, status, self.flavour.error_shape(status, msg))

    def _headers(self, record: RequestRecord, base: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if self.flavour.echo_request_id and record.x_request_id is not None:
            return [*base, ("x-request-id", record.x_request_id)]
        return base

    async def _admin(self, call: Call, out: Responder) -> None:
        self.control.recorder.admin_call(call.request.path)
        await self._reply(out, call.record, 200, {"status": "ok", "admin": call.request.path})

    async def _health(self, call: Call, out: Responder) -> None:
        status = self.control.behaviour.health_status
        if status == 200:
            await self._reply(out, call.record, 200, {"status": "healthy"})
        else:
            await self._error(out, call.record, status, "engine not ready")

    async def _models(self, call: Call, out: Responder) -> None:
        await self._reply(out, call.record, 200, responses.models_body())

    async def _wrong_method(self, call: Call, out: Responder) -> None:
        message = f"method {call.request.method} not allowed on {call.request.path}"
        await self._error(out, call.record, 405, message)

    async def _not_found(self, call: Call, out: Responder) -> None:
        await self._error(out, call.record, 404, f"route {call.request.path} not found")

    async def _inference(self, call: Call, out: Responder) -> None:
        r, rec, body = call.request, call.record, call.body
        if body is None:
            await self._error(out, rec, 400, "request body is not a JSON object")
            return
        rec.priority_inputs = self.flavour.priority_inputs(r.headers, body)
        rec.routing_inputs = self.flavour.routing_inputs(r.headers, body)
        rec.stream = body.get("stream") is True
        try:
            resolution = self.flavour.resolve(r.headers, body, self.options)
        except RejectedError as exc:
            await self._error(out, rec, exc.rejection.status, exc.rejection.message)
            return
        rec.resolved = resolution.to_json()
        behaviour = self.control.behaviour
        if behaviour.status_override is not None:
            await self._error(out, rec, behaviour.status_override, "status override")
            return
        if r.path == "/v1/embeddings":
            await self._reply(out, rec, 200, responses.embeddings_body(body))
            return
        await self._generate(r.path, body, rec, out, _Plan(resolution, behaviour))

    async def _generate(
        self, path: str, body: Mapping[str, Any], rec: RequestRecord, out: Responder, plan: _Plan
    ) -> None:
        key = ORDERING[self.flavour.name](Waiting(plan.resolution, rec.arrival_s), self.options)
        scheduler = self.control.scheduler
        try:
            await scheduler.acquire(key)
        except asyncio.CancelledError:
            self.control.recorder.finished(rec, self._clock(), aborted=True)
            raise
        try:
            self.control.recorder.started(rec, self._clock())
            tokens = responses.requested_tokens(path, body, plan.behaviour.tokens)
            run = self._stream if rec.stream else self._complete
            await run(path, responses.model_of(body), tokens, rec, out, plan.behaviour)
        except (asyncio.CancelledError, ConnectionError):
            self.control.recorder.finished(rec, self._clock(), aborted=not out.completed)
            raise
        finally:
            scheduler.release()
        self.control.recorder.finished(rec, self._clock())

    async def _complete(
        self, path: str, model: str, tokens: int, rec: RequestRecord, out: Responder, b: Behaviour
    ) -> None:
        await asyncio.sleep(tokens * b.token_delay_ms / 1000.0)
        rec.tokens_sent = tokens
        body = responses.ROUTE_FORMATS[path].body(rec.request_id, model, tokens)
        await self._reply(out, rec, 200, body)

    async def _stream(
        self, path: str, model: str, tokens: int, rec: RequestRecord, out: Responder, b: Behaviour
    ) -> None:
        fmt = responses.ROUTE_FORMATS[path]
        rec.status = 200
        await out.start(200, self._headers(rec, SSE_HEADERS))
        if self.flavour.keep_alive_comment:
            await out.write(responses.KEEP_ALIVE)
        for index in range(tokens):
            if b.fail_after_tokens is not None and index >= b.fail_after_tokens:
                out.crash()
                return
            if b.token_delay_ms:
                await asyncio.sleep(b.token_delay_ms / 1000.0)
            await out.write(fmt.chunk(rec.request_id, model, index))
            rec.tokens_sent = index + 1
        if b.fail_after_tokens is not None and tokens >= b.fail_after_tokens:
            out.crash()
            return
        for frame in fmt.end(rec.request_id, model, tokens):
            await out.write(frame)
        await out.finish()


@dataclass(frozen=True)
class _Plan:
    """What one generation runs with: its resolved priority and the behaviour at arrival."""

    resolution: Resolution
    behaviour: Behaviour


def parse_object(raw: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None when it is not one."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
