"""One HTTP/3 request stream as the handler sees it: a head, a body in, a response out.

Strategy: the protocol feeds received DATA into a bounded body buffer (the
peer only gets more credit as the handler reads, see `flow.py`) and wakes
writers when acknowledgements drain the send queue. The handler reads with
`receive()`, answers with `send_head()` / `send_data()` / `end()` (a writer
driven by callbacks uses `write()`, and `wait_drained()` once it returns
False), or gives up with `reset()`. A peer reset cancels the handler's task
(the protocol does that), so an upstream request is closed at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Protocol

from aioquic.h3.connection import ErrorCode

from tunnel.types import HeaderList, RequestHead, StreamAborted


class StreamOwner(Protocol):
    """What a stream needs from its connection (the protocol implements it)."""

    def stream_send_headers(self, stream_id: int, headers: HeaderList, *, end: bool) -> None: ...
    def stream_send_data(self, stream_id: int, data: bytes, *, end: bool) -> None: ...
    def stream_reset(self, stream_id: int, error_code: int) -> None: ...
    def stream_queued_bytes(self, stream_id: int) -> int: ...
    def stream_consumed(self, stream_id: int, byte_count: int) -> None: ...
    def stream_awaits_drain(self, stream: TunnelStream) -> None: ...


READ_BATCH_BYTES = 256 * 1024
"""Request body bytes a read waits for, short of the body's end (see `receive`)."""


class StreamLimit(StrEnum):
    """A concurrency limit a new stream arrived over; the handler must refuse it."""

    PER_CONNECTION = "per_connection"
    TOTAL = "total"


class TunnelStream:
    def __init__(
        self,
        *,
        stream_id: int,
        head: RequestHead,
        owner: StreamOwner,
        max_queued_bytes: int,
        read_batch_bytes: int = READ_BATCH_BYTES,
        over_limit: StreamLimit | None = None,
        early: bool = False,
    ) -> None:
        self.stream_id = stream_id
        self.head = head
        self.early = early
        """The request arrived as 0-RTT early data, which an attacker can replay."""
        self.over_limit = over_limit
        """Set when the stream arrived over a concurrency limit (answer it, don't serve it)."""
        self._owner = owner
        self._max_queued_bytes = max_queued_bytes
        self._read_batch_bytes = read_batch_bytes
        self._chunks: deque[bytes] = deque()
        self._unread_bytes = 0
        self._received_all = False
        self._last_arrival = time.monotonic()
        self._idle_since_last_arrival = False
        """The last read returned on the idle clock; no byte has come since."""
        self._ready = False
        """A read may return: a batch is in, the body is complete, or `hand_over` asked."""
        self._data_ready = asyncio.Event()
        self._drained = asyncio.Event()
        self._aborted: StreamAborted | None = None
        self.head_sent = False
        self.finished = False
        self.body_bytes_received = 0
        self.body_bytes_sent = 0

    # --- called by the protocol -------------------------------------------------

    def feed(self, data: bytes, *, end: bool) -> None:
        if data:
            self._chunks.append(data)
            self._unread_bytes += len(data)
            self.body_bytes_received += len(data)
            self._last_arrival = time.monotonic()
            self._idle_since_last_arrival = False
        if end:
            self._received_all = True
        if end or self._unread_bytes >= self._read_batch_bytes:
            self._ready = True
            self._data_ready.set()

    def hand_over(self) -> None:
        """Let the reader take what is buffered now, short of a batch: the peer can send
        no more until it does (flow control, see `flow.py`)."""
        if self._chunks:
            self._ready = True
            self._data_ready.set()

    def abort(self, error_code: int) -> None:
        self._aborted = StreamAborted(error_code)
        self._data_ready.set()
        self._drained.set()

    def wake_if_drained(self) -> bool:
        """Wake the waiting writer once the queue is down to half the cap; True if it did."""
        if self._owner.stream_queued_bytes(self.stream_id) <= self._max_queued_bytes // 2:
            self._drained.set()
            return True
        return False

    @property
    def received_all(self) -> bool:
        return self._received_all

    # --- the handler's side -------------------------------------------------------

    async def receive(self, idle_s: float | None = None) -> bytes:
        """Request body bytes received and not yet read, a batch at a time; b"" once the
        body is complete. TimeoutError once the peer has sent nothing for `idle_s`.

        A read returns once `read_batch_bytes` are in (or the rest of the body), not
        per datagram: each read costs the handler a wake-up, a timer, a credit update
        and an upstream write, and a 1 MiB upload is some 900 datagrams. A body that
        trickles in is not held back for long: after `idle_s` without a byte the read
        returns what is there, and the next one times out unless a byte comes first.
        The idle time counts from the last byte or from the call, whichever is later,
        since the peer may be held by flow control while the handler is not reading;
        after a read that returned on the idle clock, from the last byte only: the
        peer had credit and was silent, and the clock must not restart.
        """
        called = time.monotonic()
        while not self._ready:
            if self._aborted is not None:
                raise self._aborted
            self._data_ready.clear()
            if idle_s is None:
                await self._data_ready.wait()
                continue
            since = self._last_arrival
            if not self._idle_since_last_arrival:
                since = max(since, called)
            remaining = since + idle_s - time.monotonic()
            if remaining <= 0:
                if self._chunks:
                    self._idle_since_last_arrival = True
                    break
                raise TimeoutError(f"no request body bytes for {idle_s} s")
            try:
                async with asyncio.timeout(remaining):
                    await self._data_ready.wait()
            except TimeoutError:
                pass  # bytes may have come in meanwhile: the loop looks again
        return self.take_received()

    def take_received(self) -> bytes:
        """Every body byte received and not yet read, at once (no wait, no timer): for a
        handler that found `received_all` set, as most small requests are."""
        if self._aborted is not None:
            raise self._aborted
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._unread_bytes = 0
        self._ready = self._received_all
        if body:
            self._owner.stream_consumed(self.stream_id, len(body))
        return body

    def send_head(self, status: int, headers: HeaderList, *, end: bool = False) -> None:
        self._check_open()
        self._owner.stream_send_headers(
            self.stream_id, ((b":status", str(status).encode()), *headers), end=end
        )
        self.head_sent = True
        self.finished = end

    def send_complete(self, status: int, headers: HeaderList, body: bytes) -> None:
        """A whole small response at once (errors Pylon makes itself): no pacing needed."""
        self.send_head(status, headers)
        self._owner.stream_send_data(self.stream_id, body, end=True)
        self.body_bytes_sent += len(body)
        self.finished = True

    async def send_data(self, data: bytes) -> None:
        """Queue body bytes, then wait while more than the cap is unacknowledged."""
        if not self.write(data):
            await self.wait_drained()

    def write(self, data: bytes) -> bool:
        """Queue body bytes without waiting; False once more than the cap is unacknowledged.

        For a writer driven by callbacks: after False, await `wait_drained` before more.
        """
        self._check_open()
        if data:
            self._owner.stream_send_data(self.stream_id, data, end=False)
            self.body_bytes_sent += len(data)
        return self._owner.stream_queued_bytes(self.stream_id) <= self._max_queued_bytes

    async def wait_drained(self) -> None:
        """Wait until no more than the cap is unacknowledged (acknowledgements drain it)."""
        while self._owner.stream_queued_bytes(self.stream_id) > self._max_queued_bytes:
            self._drained.clear()
            self._owner.stream_awaits_drain(self)
            await self._drained.wait()
            self._check_open()

    def end(self, last: bytes = b"") -> None:
        """Finish the body, `last` its final bytes: they leave with the FIN."""
        self._check_open()
        self._owner.stream_send_data(self.stream_id, last, end=True)
        self.body_bytes_sent += len(last)
        self.finished = True

    def reset(self, error_code: int = ErrorCode.H3_INTERNAL_ERROR) -> None:
        """Abort the response: a truncated body must never end with a clean FIN."""
        if self.finished or self._aborted is not None:
            return
        self._owner.stream_reset(self.stream_id, error_code)
        self.finished = True

    def _check_open(self) -> None:
        if self._aborted is not None:
            raise self._aborted
        if self.finished:
            raise RuntimeError("response already finished")


Handler = Callable[[TunnelStream], Awaitable[None]]
