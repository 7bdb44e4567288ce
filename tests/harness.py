"""Real parts for end-to-end tests: a mock engine server, Pylon on port 0, an HTTP/3 client.

Nothing here is mocked: the client speaks QUIC over loopback to the real
tunnel listener, and Pylon forwards with httpx to a real HTTP/1.1 engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from backends.mock import MockEngine, MockEngineOptions
from pylon.app import RunningPylon, start_pylon
from pylon.cli import run_event_loop
from pylon.config import Settings
from tunnel.client import H3Client, client_configuration, open_client

T = TypeVar("T")

CHAT = "/v1/chat/completions"
DEFAULT_ENGINE = MockEngineOptions()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def process_alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie, exited but not yet reaped, does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return False


def run(coro: Coroutine[Any, Any, T], *, timeout_s: float = 60.0) -> T:
    """Run one async test body with a hard bound, so a hang fails instead of stalling CI."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    # The loop the product runs on (`event_loop = auto`: uvloop when installed);
    # PYLON_EVENT_LOOP=asyncio runs the tests, and the Pylons they start, on the fallback.
    return run_event_loop(bounded(), choice=os.environ.get("PYLON_EVENT_LOOP", "auto"))


@dataclass
class Stack:
    pylon: RunningPylon
    engine: MockEngine | None
    registry: CollectorRegistry

    @contextlib.asynccontextmanager
    async def client(self, *, receive_window_bytes: int | None = None) -> AsyncIterator[H3Client]:
        configuration = client_configuration(verify=False)
        if receive_window_bytes is not None:
            configuration.max_stream_data = receive_window_bytes
        async with open_client("127.0.0.1", self.pylon.port, configuration=configuration) as client:
            if receive_window_bytes is not None:
                client.limit_receive_window(receive_window_bytes)
            yield client

    def metric(self, metric_name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(metric_name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path,
    *,
    engine: MockEngineOptions | None = DEFAULT_ENGINE,
    upstream_url: str | None = None,
    **settings: Any,
) -> AsyncIterator[Stack]:
    """Mock engine (unless `engine` is None) and Pylon in front of it, both on port 0."""
    mock = MockEngine(engine) if engine is not None else None
    if mock is not None:
        await mock.start("127.0.0.1", 0)
        upstream_url = mock.url
    registry = CollectorRegistry()
    config = Settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        dev=True,
        state_dir=tmp_path / "state",
        upstream={"url": upstream_url, **settings.pop("upstream", {})},
        **settings,
    )
    pylon = await start_pylon(config, registry=registry)
    try:
        yield Stack(pylon=pylon, engine=mock, registry=registry)
    finally:
        await pylon.close()
        if mock is not None:
            await mock.close()


def tunnel_headers(request_id: str, **extra: str) -> list[tuple[str, str]]:
    headers = [("x-request-id", request_id), ("content-type", "application/json")]
    headers += [(name.replace("_", "-"), value) for name, value in extra.items()]
    return headers


async def eventually(check: Callable[[], bool | Awaitable[bool]], *, within_s: float) -> bool:
    """Poll a condition until it holds or the bound passes (a bound, not a speed goal)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
