"""The socket layer of the mock engine: HTTP/1.1 over asyncio streams with h11.

Strategy: one task per connection runs h11's loop (bytes in, events out)
with keep-alive. While a request is being answered, a watcher task keeps
reading the socket: EOF or a reset means the client went away, so the
handling task is cancelled at once (disconnects are noticed within one
event-loop turn, not at the next write); any bytes read meanwhile are fed
to h11 for the next cycle. `close()` stops listening and aborts every open
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import h11

from backends.mock.dispatcher import Dispatcher, IncomingRequest
from backends.mock.options import MockEngineOptions

READ_SIZE = 65_536


class MockEngine:
    """A real HTTP/1.1 server emulating one LLM inference engine."""

    def __init__(self, options: MockEngineOptions) -> None:
        self.options = options
        self._dispatcher = Dispatcher(options, clock=time.monotonic)
        self._server: asyncio.Server | None = None
        self._host = "127.0.0.1"
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._server = await asyncio.start_server(self._on_connection, host, port)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("mock engine not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task, writer in list(self._connections.items()):
            writer.transport.abort()
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def snapshot(self) -> dict[str, Any]:
        return self._dispatcher.control.snapshot()

    def clear(self) -> None:
        self._dispatcher.control.clear()

    def set_behaviour(self, **changes: Any) -> None:
        self._dispatcher.control.set_behaviour(changes)

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            await _Connection(reader, writer, self._dispatcher).run()
        except (ConnectionError, h11.ProtocolError):
            pass
        except asyncio.CancelledError:
            # Only close() cancels this task. asyncio.streams (3.11) calls
            # task.exception() on it, which raises for a cancelled task.
            pass
        finally:
            self._connections.pop(task, None)
            writer.transport.abort() if writer.transport.is_closing() else writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def serve_forever(
    options: MockEngineOptions,
    host: str,
    port: int,
    *,
    on_ready: Callable[[MockEngine], None] | None = None,
) -> None:
    """Run a mock engine until cancelled."""
    engine = MockEngine(options)
    await engine.start(host, port)
    try:
        if on_ready is not None:
            on_ready(engine)
        await asyncio.Event().wait()
    finally:
        await engine.close()


class _Responder:
    """Writes one response through h11; `crash()` drops the TCP connection instead."""

    def __init__(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        self._conn = conn
        self._writer = writer
        self.completed = False
        self.crashed = False

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        await self.start(status, [*headers, ("content-length", str(len(body)))])
        await self.write(body)
        await self.finish()

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        raw = [(name.encode(), value.encode()) for name, value in headers]
        self._emit(h11.Response(status_code=status, headers=raw))
        await self._writer.drain()

    async def write(self, data: bytes) -> None:
        self._emit(h11.Data(data=data))
        await self._writer.drain()

    async def finish(self) -> None:
        self._emit(h11.EndOfMessage())
        self.completed = True
        await self._writer.drain()

    def crash(self) -> None:
        self.crashed = True
        self._writer.transport.abort()

    def _emit(self, event: h11.Response | h11.Data | h11.EndOfMessage) -> None:
        data = self._conn.send(event)
        if data:
            self._writer.write(data)


class _Connection:
    """h11's server loop for one TCP connection (keep-alive, pipelining-safe)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dispatcher: Dispatcher
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._dispatcher = dispatcher
        self._conn = h11.Connection(h11.SERVER)

    async def run(self) -> None:
        while True:
            request = await self._read_request()
            if request is None or not await self._respond(request):
                return
            if self._conn.our_state is not h11.DONE or self._conn.their_state is not h11.DONE:
                return
            self._conn.start_next_cycle()

    async def _next_event(self) -> Any:
        while True:
            event = self._conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._conn.receive_data(await self._reader.read(READ_SIZE))

    async def _read_request(self) -> IncomingRequest | None:
        event = await self._next_event()
        if not isinstance(event, h11.Request):
            return None
        if self._conn.they_are_waiting_for_100_continue:
            self._writer.write(
                self._conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )
        body = bytearray()
        while True:
            part = await self._next_event()
            if isinstance(part, h11.Data):
                body += part.data
            elif isinstance(part, h11.EndOfMessage):
                break
            else:
                return None
        target = event.target.decode("latin-1")
        return IncomingRequest(
            method=event.method.decode("ascii"),
            path=target.split("?", 1)[0],
            headers=tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers),
            body=bytes(body),
        )

    async def _respond(self, request: IncomingRequest) -> bool:
        """Answer one request; False when the connection must not be reused."""
        out = _Responder(self._conn, self._writer)
        handler = asyncio.create_task(self._dispatcher.handle(request, out))
        watcher = asyncio.create_task(self._watch())
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not handler.done():
                handler.cancel()  # client disconnected (or the engine is closing)
            watcher.cancel()
            await asyncio.gather(handler, watcher, return_exceptions=True)
        if handler.cancelled() or handler.exception() is not None:
            return False
        return out.completed and not out.crashed

    async def _watch(self) -> None:
        """Read while the answer is produced: returns on EOF, raises on reset."""
        while True:
            data = await self._reader.read(READ_SIZE)
            if not data:
                return
            self._conn.receive_data(data)  # pipelined bytes wait for the next cycle
