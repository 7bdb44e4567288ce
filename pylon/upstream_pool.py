"""The upstream keep-alive pool: O(1) bookkeeping for connections to the engine.

Strategy: a slot counter caps open connections (opening, in use and idle all
hold one); idle connections wait per origin in a LIFO deque, stamped with the
time they went idle, so the freshest is reused first and the oldest sit at the
left end where expiry trims them. Requests beyond the cap wait in one FIFO
queue; whatever frees up (a connection, or a slot) is handed straight to the
first waiter, so a newcomer never overtakes a queued request. Hence while any
request waits, no connection is idle.

httpcore's pool instead re-examines every connection on every request start
and end, with a readability poll each; at 256 streams that was a third of
Pylon's CPU (docs/performance.md). Time is a parameter (`now`) and nothing
here awaits except the queued wait itself.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

Origin = tuple[str, str, int]
"""(scheme, host, port): connections are only reused for the origin they were opened to."""


class Poolable(Protocol):
    origin: Origin

    def alive(self) -> bool:
        """False once the peer closed it, broke it or wrote to it unasked (never hand it out)."""

    def close(self) -> None: ...


C = TypeVar("C", bound=Poolable)


class PoolClosed(Exception):
    """The pool was closed while a request waited for a connection."""


@dataclass(frozen=True)
class PoolStats:
    open: int
    """Connections open or being opened (each holds a slot)."""
    idle: int
    """Of those, idle in the pool."""
    waiting: int
    """Requests queued for a connection."""


class KeepAlivePool(Generic[C]):
    def __init__(
        self, *, max_connections: int, max_keepalive: int, keepalive_expiry_s: float
    ) -> None:
        self._max_connections = max_connections
        self._max_keepalive = max_keepalive
        self._expiry_s = keepalive_expiry_s
        self._open = 0
        self._members: set[C] = set()
        self._idle: dict[Origin, deque[tuple[float, C]]] = {}
        self._idle_count = 0
        self._waiters: deque[tuple[Origin, asyncio.Future[C | None]]] = deque()
        self._closed = False

    def stats(self) -> PoolStats:
        waiting = sum(1 for _, future in self._waiters if not future.done())
        return PoolStats(open=self._open, idle=self._idle_count, waiting=waiting)

    async def acquire(self, origin: Origin, *, now: float, timeout_s: float | None) -> C | None:
        """A live idle connection to `origin`, or None: the caller holds a slot and connects.

        Raises TimeoutError when nothing freed up within `timeout_s`.
        """
        if self._closed:
            raise PoolClosed("the upstream pool is closed")
        connection = self._take_idle(origin, now)
        if connection is not None:
            return connection
        if self._open < self._max_connections or self._evict_idle():
            self._open += 1
            return None
        future: asyncio.Future[C | None] = asyncio.get_running_loop().create_future()
        self._waiters.append((origin, future))
        try:
            async with asyncio.timeout(timeout_s):
                granted = await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._give_back(future.result(), now=now)
            raise
        if granted is not None and not granted.alive():
            self._forget(granted)  # its slot is now ours
            return None
        return granted

    def opened(self, connection: C) -> None:
        """The caller connected with the slot `acquire` gave it."""
        self._members.add(connection)

    def unused_slot(self) -> None:
        """The caller could not connect with the slot `acquire` gave it."""
        self._free_slot()

    def release(self, connection: C, *, now: float) -> None:
        """Back to the pool after a complete exchange (the caller checked it is reusable)."""
        if connection not in self._members:
            return
        if self._closed or not connection.alive():
            self.discard(connection)
            return
        waiter = self._next_waiter()
        if waiter is not None:
            origin, future = waiter
            if origin == connection.origin:
                future.set_result(connection)
            else:
                self._forget(connection)  # the slot goes to the waiter's own connection
                future.set_result(None)
            return
        idle = self._idle.setdefault(connection.origin, deque())
        idle.append((now, connection))
        self._idle_count += 1
        while idle and (self._idle_count > self._max_keepalive or self._expired(idle[0][0], now)):
            self._drop_oldest(idle)

    def discard(self, connection: C) -> None:
        """Close a connection that is not idle in the pool, freeing its slot."""
        if connection in self._members:
            self._forget(connection)
            self._free_slot()

    def close(self) -> None:
        self._closed = True
        for connection in self._members:
            connection.close()
        self._members.clear()
        self._idle.clear()
        self._open = self._idle_count = 0
        while self._waiters:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(PoolClosed("the upstream pool is closed"))

    def _take_idle(self, origin: Origin, now: float) -> C | None:
        idle = self._idle.get(origin)
        # The oldest sit at the left: trim the expired, then reuse the freshest live one.
        while idle and self._expired(idle[0][0], now):
            self._drop_oldest(idle)
        while idle:
            connection = idle.pop()[1]
            self._idle_count -= 1
            if connection.alive():
                return connection
            self.discard(connection)
        return None

    def _drop_oldest(self, idle: deque[tuple[float, C]]) -> None:
        self._idle_count -= 1
        self.discard(idle.popleft()[1])

    def _evict_idle(self) -> bool:
        """At the cap, close the oldest idle connection to another origin to make room."""
        for idle in self._idle.values():
            if idle:
                self._idle_count -= 1
                self._forget(idle.popleft()[1])
                self._open -= 1
                return True
        return False

    def _expired(self, since: float, now: float) -> bool:
        return now - since >= self._expiry_s

    def _give_back(self, granted: C | None, *, now: float) -> None:
        """A waiter was granted something but left (timeout, cancellation) before using it."""
        if granted is None:
            self._free_slot()
        else:
            self.release(granted, now=now)

    def _forget(self, connection: C) -> None:
        """Close and stop tracking a connection; its slot stays taken."""
        self._members.discard(connection)
        connection.close()

    def _free_slot(self) -> None:
        waiter = self._next_waiter()
        if waiter is not None:
            waiter[1].set_result(None)
        else:
            self._open -= 1

    def _next_waiter(self) -> tuple[Origin, asyncio.Future[C | None]] | None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter[1].done():
                return waiter
        return None
