"""The admin HTTP server: /metrics, /healthz and /readyz over plain TCP.

Strategy: no web framework and no threads. h11 (bytes in, events out) over
`asyncio.start_server`, on Pylon's own event loop, so /healthz answering at
all is the proof that the loop is responsive. Responses are built by small
functions over the registry and the readiness flags (`AdminRoutes`); the
connection loop only moves bytes. Keep-alive is supported because Prometheus
reuses its scrape connection; idle connections are closed after a while, and
only GET and HEAD are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
from prometheus_client import CollectorRegistry, generate_latest

from pylon.readiness import Readiness

__all__ = [
    "AdminResponse",
    "AdminRoutes",
    "AdminServer",
    "Respond",
    "start_admin",
    "start_admin_server",
]

logger = logging.getLogger("pylon.admin")

READ_SIZE = 65_536
IDLE_TIMEOUT_S = 120.0
"""Longer than Prometheus' usual scrape intervals (15-60 s), so its keep-alive
connection is reused; a connection closed for idling is simply reopened."""
MAX_REQUEST_BODY_BYTES = 16 * 1024
"""A GET has no business carrying a body; this only bounds what is discarded."""
TEXT = "text/plain; charset=utf-8"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
"""What `generate_latest` writes (legacy names, underscores): the classic text
format every Prometheus version parses."""


@dataclass(frozen=True)
class AdminResponse:
    status: int
    content_type: str
    body: bytes


Respond = Callable[[str, str], Awaitable[AdminResponse]]
"""(method, target) -> response: what the connection loop asks of a route table."""


class AdminRoutes:
    """Path -> response; pure apart from the live gauges read by `generate_latest`."""

    def __init__(self, *, registry: CollectorRegistry, readiness: Readiness) -> None:
        self._registry = registry
        self._readiness = readiness
        self._table: dict[str, Callable[[], AdminResponse]] = {
            "/metrics": self.metrics,
            "/healthz": self.healthz,
            "/readyz": self.readyz,
        }

    def respond(self, method: str, target: str) -> AdminResponse:
        route = self._table.get(target.split("?", 1)[0])
        if route is None:
            return AdminResponse(404, TEXT, b"not found\n")
        if method not in ("GET", "HEAD"):
            return AdminResponse(405, TEXT, b"method not allowed\n")
        return route()

    def metrics(self) -> AdminResponse:
        return AdminResponse(200, PROMETHEUS_TEXT, generate_latest(self._registry))

    def healthz(self) -> AdminResponse:
        return AdminResponse(200, TEXT, b"ok\n")

    def readyz(self) -> AdminResponse:
        reasons = self._readiness.reasons()
        if not reasons:
            return AdminResponse(200, TEXT, b"ready\n")
        return AdminResponse(503, TEXT, f"not ready: {', '.join(reasons)}\n".encode())

    async def respond_async(self, method: str, target: str) -> AdminResponse:
        return self.respond(method, target)


class _BadRequest(Exception):
    pass


class _AdminConnection:
    """h11's server loop for one TCP connection."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, respond: Respond
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._respond_to = respond
        self._conn = h11.Connection(h11.SERVER)

    async def run(self) -> None:
        while True:
            try:
                request = await self._read_request()
            except (_BadRequest, h11.RemoteProtocolError):
                await self._send(AdminResponse(400, TEXT, b"bad request\n"), head_only=False)
                return
            if request is None:
                return
            method = request.method.decode("ascii", "replace")
            response = await self._respond(method, request.target.decode("latin-1"))
            await self._send(response, head_only=method == "HEAD")
            if self._conn.our_state is not h11.DONE or self._conn.their_state is not h11.DONE:
                return
            self._conn.start_next_cycle()

    async def _respond(self, method: str, target: str) -> AdminResponse:
        try:
            return await self._respond_to(method, target)
        except Exception:  # a failing live gauge must not kill the admin server
            logger.exception("admin %s %s failed", method, target)
            return AdminResponse(500, TEXT, b"internal error\n")

    async def _next_event(self) -> Any:
        while True:
            event = self._conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                data = await self._reader.read(READ_SIZE)
            self._conn.receive_data(data)

    async def _read_request(self) -> h11.Request | None:
        """The next request with its body discarded; None when the peer is done or idle."""
        try:
            return await self._read_whole_request()
        except TimeoutError:
            return None

    async def _read_whole_request(self) -> h11.Request | None:
        event = await self._next_event()
        if not isinstance(event, h11.Request):
            return None
        discarded = 0
        while not isinstance(part := await self._next_event(), h11.EndOfMessage):
            if not isinstance(part, h11.Data):
                return None
            discarded += len(part.data)
            if discarded > MAX_REQUEST_BODY_BYTES:
                raise _BadRequest
        return event

    async def _send(self, response: AdminResponse, *, head_only: bool) -> None:
        if self._conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            ("cache-control", "no-store"),
        ]
        self._emit(h11.Response(status_code=response.status, headers=headers))
        if not head_only:
            self._emit(h11.Data(data=response.body))
        self._emit(h11.EndOfMessage())
        await self._writer.drain()

    def _emit(self, event: h11.Response | h11.Data | h11.EndOfMessage) -> None:
        data = self._conn.send(event)
        if data:
            self._writer.write(data)


class AdminServer:
    """A bound admin listener; `port` is the real port when 0 was asked for."""

    def __init__(self, respond: Respond) -> None:
        self._respond = respond
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def listen(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._on_connection, host, port)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("admin server not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task, writer in list(self._connections.items()):
            writer.transport.abort()
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            await _AdminConnection(reader, writer, self._respond).run()
        except (ConnectionError, h11.LocalProtocolError):
            pass
        except asyncio.CancelledError:
            # Only close() cancels this task; asyncio.streams (3.11) calls
            # task.exception() on it, which would raise for a cancelled task.
            pass
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def start_admin(
    host: str, port: int, *, registry: CollectorRegistry, readiness: Readiness
) -> AdminServer:
    routes = AdminRoutes(registry=registry, readiness=readiness)
    return await start_admin_server(host, port, routes.respond_async)


async def start_admin_server(host: str, port: int, respond: Respond) -> AdminServer:
    server = AdminServer(respond)
    await server.listen(host, port)
    logger.info("admin server on %s:%d (/metrics, /healthz, /readyz)", host, server.port)
    return server
