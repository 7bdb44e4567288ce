"""The upstream keep-alive pool's bookkeeping, with stand-in connections and no sockets.

The races here (a waiter handed a connection, then cancelled before it ran)
are hard to hit through real sockets; the socket-level behaviour is in
test_upstream_transport.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.upstream_pool import KeepAlivePool, Origin, PoolStats
from tests.harness import run

ENGINE: Origin = ("http", "127.0.0.1", 8000)
OTHER: Origin = ("http", "127.0.0.1", 8001)


@dataclass(eq=False)
class FakeConnection:
    origin: Origin = ENGINE
    closed: bool = False
    peer_closed: bool = False

    def alive(self) -> bool:
        return not (self.closed or self.peer_closed)

    def close(self) -> None:
        self.closed = True


def pool(*, max_connections: int = 1, max_keepalive: int = 1, expiry_s: float = 30.0) -> Pool:
    return KeepAlivePool(
        max_connections=max_connections, max_keepalive=max_keepalive, keepalive_expiry_s=expiry_s
    )


Pool = KeepAlivePool[FakeConnection]


async def connected(p: Pool, origin: Origin = ENGINE) -> FakeConnection:
    assert await p.acquire(origin, now=0.0, timeout_s=None) is None
    connection = FakeConnection(origin)
    p.opened(connection)
    return connection


@pytest.mark.parametrize("handed", ["connection", "slot"])
def test_a_waiter_cancelled_after_its_grant_gives_it_back(handed: str) -> None:
    async def scenario() -> None:
        p = pool()
        held = await connected(p)
        waiter = asyncio.ensure_future(p.acquire(ENGINE, now=0.0, timeout_s=None))
        await asyncio.sleep(0)
        assert p.stats().waiting == 1
        if handed == "connection":
            p.release(held, now=0.0)
        else:
            p.discard(held)
        waiter.cancel()  # before the waiter ran: the grant is in its future
        with pytest.raises(asyncio.CancelledError):
            await waiter
        expected = (
            PoolStats(open=1, idle=1, waiting=0)
            if handed == "connection"
            else PoolStats(open=0, idle=0, waiting=0)
        )
        assert p.stats() == expected

    run(scenario())


def test_a_waiter_handed_a_connection_that_died_connects_afresh() -> None:
    async def scenario() -> None:
        p = pool()
        held = await connected(p)
        waiter = asyncio.ensure_future(p.acquire(ENGINE, now=0.0, timeout_s=None))
        await asyncio.sleep(0)
        p.release(held, now=0.0)
        held.peer_closed = True  # between the hand-over and the waiter running
        assert await waiter is None, "the waiter should get the slot, not the dead connection"
        assert held.closed
        assert p.stats() == PoolStats(open=1, idle=0, waiting=0)

    run(scenario())


def test_the_freshest_idle_connection_is_reused_and_expired_ones_closed() -> None:
    async def scenario() -> None:
        p = pool(max_connections=3, max_keepalive=3, expiry_s=10.0)
        old, newer, newest = [await connected(p) for _ in range(3)]
        for now, connection in ((0.0, old), (5.0, newer), (9.0, newest)):
            p.release(connection, now=now)
        assert await p.acquire(ENGINE, now=12.0, timeout_s=None) is newest
        assert old.closed and not newer.closed  # trimmed from the old end on the way
        assert await p.acquire(ENGINE, now=16.0, timeout_s=None) is None  # newer expired too
        assert newer.closed
        assert p.stats() == PoolStats(open=2, idle=0, waiting=0)

    run(scenario())


def test_at_the_cap_an_idle_connection_to_another_engine_makes_room() -> None:
    async def scenario() -> None:
        p = pool()
        other = await connected(p, OTHER)
        p.release(other, now=0.0)
        assert await p.acquire(ENGINE, now=0.0, timeout_s=0.01) is None
        assert other.closed
        assert p.stats() == PoolStats(open=1, idle=0, waiting=0)

    run(scenario())


def test_closing_the_pool_fails_its_waiters_and_closes_everything() -> None:
    async def scenario() -> None:
        p = pool()
        held = await connected(p)
        waiter = asyncio.ensure_future(p.acquire(ENGINE, now=0.0, timeout_s=None))
        await asyncio.sleep(0)
        p.close()
        with pytest.raises(Exception, match="closed"):
            await waiter
        assert held.closed
        assert p.stats() == PoolStats(open=0, idle=0, waiting=0)

    run(scenario())


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "release", "discard", "peer closes", "time passes"]),
        st.integers(0, 7),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(operations=OPERATIONS, max_keepalive=st.integers(0, 3))
def test_the_pool_never_exceeds_its_limits_or_hands_out_a_dead_connection(
    operations: list[tuple[str, int]], max_keepalive: int
) -> None:
    """Any sequence of requests starting, ending, failing and engines closing keeps the books."""

    async def scenario() -> None:
        p = pool(max_connections=3, max_keepalive=max_keepalive, expiry_s=10.0)
        in_use: list[FakeConnection] = []
        every: list[FakeConnection] = []
        now = 0.0
        for operation, pick in operations:
            if operation == "acquire":
                try:
                    connection = await p.acquire(ENGINE, now=now, timeout_s=0)
                except TimeoutError:
                    assert len(in_use) == 3
                    continue
                if connection is None:
                    connection = FakeConnection()
                    every.append(connection)
                    p.opened(connection)
                assert connection.alive() and connection not in in_use
                in_use.append(connection)
            elif operation == "time passes":
                now += pick * 2
            elif operation == "peer closes" and every:
                every[pick % len(every)].peer_closed = True
            elif in_use:
                connection = in_use.pop(pick % len(in_use))
                if operation == "release":
                    p.release(connection, now=now)
                else:
                    p.discard(connection)
            stats = p.stats()
            assert stats.open <= 3 and stats.idle <= max_keepalive
            assert stats.open == len(in_use) + stats.idle
            open_ones = [c for c in every if not c.closed]
            assert len(open_ones) == stats.open, "closed or leaked connection miscounted"

    run(scenario())
