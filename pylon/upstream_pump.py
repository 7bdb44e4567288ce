"""The engine's response body, pushed from the socket callback into a sink.

Strategy: while a body streams, a `BodyPump` is attached to the connection's
`UpstreamReader`; each socket read is parsed inside the reader's `feed_data`
callback and the body chunks are written straight to a `BodySink` (the tunnel
stream), so an SSE event costs no task wake-up and no trip through a chain of
async iterators (0.88-0.99x the CPU per event, docs/performance.md). The end
of the body ends the sink in the same callback, so the FIN leaves in the
packet that carries the last bytes instead of one of its own. The
relaying task sleeps until the body ends, or until the sink is backlogged:
then the socket is not read until the sink drains, the same backpressure as
the pull path (`UpstreamConnection.next_event`). Once the body is complete the
pump lets go of the reader, so bytes after it are buffered and counted as any
unasked bytes are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import httpx

from pylon.upstream_connection import READ_BYTES, UpstreamConnection, describe_os_error
from pylon.upstream_response import END_OF_BODY, NEED_DATA


class BodySink(Protocol):
    """Where `relay_body` writes a response body (the tunnel stream implements it)."""

    def write(self, data: bytes) -> bool:
        """Queue `data` without waiting; False once the sink is backlogged."""

    async def wait_drained(self) -> None:
        """Return once the sink takes more again."""

    def end(self, last: bytes = b"") -> None:
        """The body is complete, `last` its final bytes (never called for a body that failed)."""


class BodyPump:
    """Feeds one response body from the socket callback into the parser and out to a sink.

    Runs inside `UpstreamReader.feed_data` and `feed_eof`, so nothing here
    awaits or raises: the outcome (complete, or the error that ended it) is
    left in `done` and `error`, and the relaying task is woken only when it
    must act.
    """

    def __init__(
        self,
        connection: UpstreamConnection,
        sink: BodySink,
        *,
        idle_timeout_s: float | None,
        on_first_chunk: Callable[[], None],
    ) -> None:
        self._connection = connection
        self._response = connection.response
        self._sink = sink
        self._loop = asyncio.get_running_loop()
        self._on_first_chunk: Callable[[], None] | None = on_first_chunk
        self._idle_timeout_s = idle_timeout_s
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_data_at = self._loop.time()
        self._wake: asyncio.Future[None] | None = None
        self._engine_closed = False
        """The reader ended (EOF or an error): once the parser runs dry, that decides."""
        self.done = False
        self.backlogged = False
        """The sink said stop: nothing more is written until the task has waited for it."""
        self._reading_paused = False
        self._unwritten = b""
        """Body bytes the parser gave out that the backlogged sink has not taken yet."""
        self.error: BaseException | None = None

    def watch_idle(self) -> None:
        """Start the idle budget: for a body that did not come whole with the head."""
        if self._idle_timeout_s is not None and not self.done:
            delay = self._last_data_at + self._idle_timeout_s - self._loop.time()
            self._idle_timer = self._loop.call_later(delay, self._check_idle)

    def received(self, data: bytes) -> None:
        """One socket read: counted as read, parsed, and written out unless backlogged."""
        self._connection.count_read(len(data))
        self._last_data_at = self._loop.time()
        try:
            self._response.receive_data(data)
        except Exception as exc:  # RemoteProtocolError; nothing may escape the socket callback
            self._finish(exc)
            return
        if not self.backlogged:  # else the parser keeps the events until `resume`
            self.parse()

    def ended(self) -> None:
        """The engine closed; it counts once the parser has given out what came before."""
        self._engine_closed = True
        if not self.backlogged:
            self.parse()

    def parse(self) -> None:
        """Write every body chunk the parser holds, until it needs data or the sink is full."""
        try:
            if self._unwritten:
                unwritten, self._unwritten = self._unwritten, b""
                if not self._write(unwritten):
                    self._pause()
                    return
            while not self.done:
                event = self._response.next_event()
                if type(event) is bytes:
                    if self._on_first_chunk is not None:
                        self._on_first_chunk()
                        self._on_first_chunk = None
                    if len(event) <= READ_BYTES and self._response.ends_next():
                        # The last bytes and the end in one call: one DATA frame with
                        # the FIN (a small response's whole body), not two writes.
                        self._response.next_event()
                        self._sink.end(event)
                        self._finish(None)
                        return
                    if not self._write(event):
                        # Later events stay queued in the parser: the sink's cap
                        # overshoots by one piece, not by one whole socket read.
                        self._pause()
                        return
                elif event is END_OF_BODY:
                    self._sink.end()
                    self._finish(None)
                elif event is NEED_DATA:
                    if not self._engine_closed:
                        return
                    self._receive_end()
                else:
                    raise httpx.RemoteProtocolError(f"engine sent {event!r} mid-body")
        except Exception as exc:  # the parser's, or the sink's (the gateway reset): re-raised
            self._finish(exc)

    def _receive_end(self) -> None:
        """The reader's end, as `next_event` reads it: its error, else EOF for the parser
        (which ends a body delimited by the close and raises for any other)."""
        error = self._connection.reader.exception()
        if error is not None:
            raise httpx.ReadError(describe_os_error(error)) from error
        self._response.receive_eof()

    def _write(self, data: bytes) -> bool:
        """Write in pieces of at most READ_BYTES (what one pull read takes); once the
        sink is backlogged, keep the rest for `resume`."""
        if len(data) <= READ_BYTES:
            return self._sink.write(data)
        for offset in range(0, len(data), READ_BYTES):
            if not self._sink.write(data[offset : offset + READ_BYTES]):
                self._unwritten = data[offset + READ_BYTES :]
                return False
        return True

    async def wait(self) -> None:
        """Sleep until the body ended or the sink is backlogged."""
        if self.done or self.backlogged:
            return
        self._wake = self._loop.create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def resume(self) -> None:
        """The sink drained: write what the parser still holds, then read the socket again."""
        self.backlogged = False
        if self.done:  # ended by an error while backlogged: nothing more goes out
            return
        self._last_data_at = self._loop.time()
        self.parse()
        if not self.backlogged:
            self._resume_reading()

    def stop(self) -> None:
        """Detach from the socket, leaving the connection as a pull reader finds it."""
        self._connection.reader.pump = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._resume_reading()

    def _pause(self) -> None:
        self.backlogged = True
        if not self._reading_paused:
            self._reading_paused = True
            self._connection.transport.pause_reading()
        self._wake_task()

    def _resume_reading(self) -> None:
        transport = self._connection.transport
        if self._reading_paused and not transport.is_closing():
            transport.resume_reading()
        self._reading_paused = False

    def _finish(self, error: BaseException | None) -> None:
        self.done = True
        self.error = error
        self._connection.reader.pump = None  # bytes after the body are the pool's business
        self._wake_task()

    def _wake_task(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _check_idle(self) -> None:
        assert self._idle_timeout_s is not None
        if self.done:
            return
        remaining = self._last_data_at + self._idle_timeout_s - self._loop.time()
        if self.backlogged or remaining > 0:
            # Waiting for the gateway to drain is not the engine being silent.
            delay = self._idle_timeout_s if self.backlogged else remaining
            self._idle_timer = self._loop.call_later(delay, self._check_idle)
            return
        self._finish(httpx.ReadTimeout(f"engine silent for {self._idle_timeout_s} s mid-body"))


async def relay_body(
    connection: UpstreamConnection,
    sink: BodySink,
    *,
    idle_timeout_s: float | None,
    on_first_chunk: Callable[[], None],
) -> None:
    """Write the response body to `sink` as it arrives, and end `sink` once it is complete.

    Raises httpx's exceptions as `next_event` would (a silent engine is a
    `ReadTimeout`), or whatever the sink raised.
    """
    pump = BodyPump(connection, sink, idle_timeout_s=idle_timeout_s, on_first_chunk=on_first_chunk)
    reader = connection.reader
    try:
        buffered = connection.buffered_bytes()
        if buffered:  # came in with the head, so this read returns at once
            pump.received(await reader.readexactly(buffered))
        else:
            pump.parse()  # the parser may hold body chunks, even the whole body
        if not pump.done:
            # A small response is usually whole by now: no timer to arm and cancel.
            pump.watch_idle()
            reader.pump = pump
            if reader.at_eof():
                pump.ended()
        while not pump.done:
            await pump.wait()
            if pump.backlogged and not pump.done:
                await sink.wait_drained()
                pump.resume()
    finally:
        pump.stop()
    if pump.error is not None:
        raise pump.error
