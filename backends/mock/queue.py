"""Queue order of the mock engines: pure ordering keys plus an asyncio slot scheduler.

Strategy: each engine's waiting-request order is one pure function returning
a sort key (smaller = served first), chosen from a table by engine name;
arrival time is a parameter, never read here. `SlotScheduler` admits at most
`slots` requests at once and hands a freed slot to the smallest key.

Deliberate simplification: SGLang preempts a running request when a new one's
priority differs by more than `--priority-scheduling-preemption-threshold`;
the mock never preempts a running request, it only orders the waiting ones.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from backends.mock.flavours import Resolution
from backends.mock.options import MockEngineOptions

SortKey = tuple[float, ...]


@dataclass(frozen=True)
class Waiting:
    """What the queue knows about one request."""

    resolution: Resolution
    arrival_s: float
    """Monotonic arrival time in seconds."""


def dynamo_key(item: Waiting, _opts: MockEngineOptions) -> SortKey:
    """Strict tier first (higher first), then max(priority, 0) - arrival (higher first).

    Priority is seconds of head start; latency_sensitivity is the jump when no
    priority exists at all.
    """
    res = item.resolution
    jump = res.priority if res.priority is not None else (res.jump or 0.0)
    return (-float(res.strict_priority or 0), -(max(jump, 0) - item.arrival_s))


def vllm_key(item: Waiting, opts: MockEngineOptions) -> SortKey:
    """Lower priority first, ties by arrival; fcfs: arrival only."""
    if opts.vllm_scheduling_policy != "priority" or item.resolution.priority is None:
        return (0.0, item.arrival_s)
    return (float(item.resolution.priority), item.arrival_s)


def sglang_key(item: Waiting, opts: MockEngineOptions) -> SortKey:
    """Higher first (lower with low_values_first); no priority runs last; ties by arrival."""
    priority = item.resolution.priority
    if not opts.sglang_priority_scheduling:
        return (0.0, 0.0, item.arrival_s)
    if priority is None:
        return (1.0, 0.0, item.arrival_s)
    rank = float(priority) if opts.sglang_low_values_first else -float(priority)
    return (0.0, rank, item.arrival_s)


def fcfs_key(item: Waiting, _opts: MockEngineOptions) -> SortKey:
    return (item.arrival_s,)


ORDERING: dict[str, Callable[[Waiting, MockEngineOptions], SortKey]] = {
    "dynamo": dynamo_key,
    "vllm": vllm_key,
    "sglang": sglang_key,
    "openai": fcfs_key,
}


class SlotScheduler:
    """At most `slots` holders at once (None = unlimited, 0 = paused); waiters by key."""

    def __init__(self, slots: int | None) -> None:
        self._slots = slots
        self._running = 0
        self._waiters: list[tuple[SortKey, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, fut in self._waiters if not fut.done())

    @property
    def running(self) -> int:
        return self._running

    def set_slots(self, slots: int | None) -> None:
        self._slots = slots
        self._pump()

    async def acquire(self, key: SortKey) -> None:
        if not self._waiters and self._has_room():
            self._running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (key, next(self._seq), fut))
        self._pump()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was granted just as we were cancelled
            raise

    def release(self) -> None:
        self._running -= 1
        self._pump()

    def _has_room(self) -> bool:
        return self._slots is None or self._running < self._slots

    def _pump(self) -> None:
        while self._waiters and self._has_room():
            _, _, fut = heapq.heappop(self._waiters)
            if fut.done():
                continue  # cancelled while waiting
            self._running += 1
            fut.set_result(None)
