"""Candidate: the upstream HTTP/1.1 exchange over asyncio streams and h11, without httpx.

Profiles of Pylon (docs/performance.md) put a third of its CPU in httpx and
httpcore: the pool's O(N^2) bookkeeping, anyio and sniffio per call, and the
per-chunk read path. This launcher swaps `pylon.app.Forwarder` for one that
keeps a free list of keep-alive connections and speaks HTTP/1.1 with h11 (a
Pylon dependency already). It yields what the real forwarder yields (status,
headers, `chunks()`), keeps the idle watchdog, and skips what a measurement
does not exercise: error mapping, the retry on a dead pooled connection and
the response-head timeout. It is a measurement, not a replacement.

Run: python -m bench compare --workload stream \
        --candidate-command "python -m bench.experiments.lean_upstream"
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

import pylon.app
from pylon.config import UpstreamSettings
from pylon.forwarder import IdleWatchdog
from pylon.tunnel_headers import REQUEST_ID, strip_hop_by_hop

READ_BYTES = 64 * 1024


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))

    async def next_event(self) -> Any:
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            self.h11.receive_data(await self.reader.read(READ_BYTES))
        return event

    def send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)


@dataclass
class LeanResponse:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    _connection: _Connection
    _idle_timeout_s: float
    complete: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        watchdog = IdleWatchdog(self._idle_timeout_s)
        try:
            while True:
                watchdog.waiting()
                event = await self._connection.next_event()
                watchdog.idle()
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self.complete = True
                    return
                else:
                    raise ConnectionError(f"engine: unexpected {type(event).__name__}")
        finally:
            watchdog.stop()


class LeanForwarder:
    def __init__(self, _client: Any, settings: UpstreamSettings) -> None:
        url = urlsplit(settings.url or "")
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._authority = url.netloc.encode()
        self._settings = settings
        self._idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.reader.at_eof():
                return connection
            connection.writer.close()
        reader, writer = await asyncio.open_connection(self._host, self._port)
        return _Connection(reader, writer)

    @contextlib.asynccontextmanager
    async def exchange(
        self,
        *,
        method: str,
        path: str,
        headers: tuple[tuple[bytes, bytes], ...],
        content: bytes | AsyncIterable[bytes],
        request_id: str | None,
    ) -> AsyncIterator[LeanResponse]:
        connection = await self._connection()
        response: LeanResponse | None = None
        try:
            await self._send(connection, method, path, headers, content)
            head = await connection.next_event()
            response = LeanResponse(
                head.status_code,
                _response_headers(head.headers, request_id),
                connection,
                self._settings.idle_timeout_s,
            )
            yield response
        finally:
            reusable = response is not None and response.complete
            if reusable and connection.h11.our_state is connection.h11.their_state is h11.DONE:
                connection.h11.start_next_cycle()
                self._idle.append(connection)
            else:
                connection.writer.close()

    async def _send(
        self,
        connection: _Connection,
        method: str,
        path: str,
        headers: tuple[tuple[bytes, bytes], ...],
        content: bytes | AsyncIterable[bytes],
    ) -> None:
        framing = (
            (b"content-length", str(len(content)).encode())
            if isinstance(content, bytes)
            else (b"transfer-encoding", b"chunked")
        )
        head = [(b"host", self._authority), *headers, framing]
        connection.send(h11.Request(method=method, target=path, headers=head))
        if isinstance(content, bytes):
            if content:
                connection.send(h11.Data(data=content))
        else:
            async for chunk in content:
                connection.send(h11.Data(data=chunk))
                await connection.writer.drain()
        connection.send(h11.EndOfMessage())
        await connection.writer.drain()


def _response_headers(raw: Any, request_id: str | None) -> tuple[tuple[bytes, bytes], ...]:
    pairs = [(bytes(name), bytes(value)) for name, value in raw]
    kept = [(n, v) for n, v in strip_hop_by_hop(pairs) if n != REQUEST_ID]
    if request_id is not None:
        kept.append((REQUEST_ID, request_id.encode("ascii")))
    kept += [(n, v) for n, v in pairs if n == b"content-length"]
    return tuple(kept)


def main() -> int:
    setattr(pylon.app, "Forwarder", LeanForwarder)  # noqa: B010 (patch for the experiment)
    from pylon.cli import main as pylon_main

    return pylon_main()


if __name__ == "__main__":
    sys.exit(main())
