"""SIGTERM/SIGINT for a serving process: the first starts a drain, a second cuts it short.

`pylon serve` (one process) and the multi-process supervisor shut down the
same way; this module is that shared part, so both count signals alike.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["SecondSignal", "ShutdownSignals"]

T = TypeVar("T")


class SecondSignal(Exception):
    """Another signal arrived while the drain ran: stop without waiting."""


class ShutdownSignals:
    """SIGINT and SIGTERM queued on the running loop (installed on construction)."""

    def __init__(self) -> None:
        self._received = asyncio.Queue[int]()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._received.put_nowait, signum)

    async def first(self) -> int:
        return await self._received.get()

    async def unless_another(self, drain: Coroutine[Any, Any, T]) -> T:
        """`drain`'s result, or SecondSignal (and `drain` cancelled) if a signal comes first."""
        draining = asyncio.ensure_future(drain)
        second = asyncio.ensure_future(self._received.get())
        done, _ = await asyncio.wait({draining, second}, return_when=asyncio.FIRST_COMPLETED)
        for task in (draining, second):
            task.cancel()
        if second in done:
            raise SecondSignal
        return draining.result()
