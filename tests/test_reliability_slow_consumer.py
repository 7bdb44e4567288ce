"""A slow consumer: a 50 MiB response read at a trickle, beside a normal request.

The slow stream gets response credit only as it reads (a per-stream window in
the test client), so Pylon's writer must wait for acknowledgements and stop
reading the engine: its queued bytes stay near `limits.max_queued_response_bytes`
for the whole 50 MiB. A second request on the same connection must complete
while the slow one is still going (no head-of-line blocking, no starvation).

The 50 MiB is one non-streamed completion of five million tokens, relayed
chunk by chunk as it arrives: the same path as a token stream, but a 50 MiB
SSE stream is 330,000 events and takes over 30 s in one process (the SSE
slow-reader case is `test_e2e_core.test_slow_reader_keeps_queued_bytes_bounded`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from backends.mock import MockEngineOptions
from tests.harness import CHAT, Stack, run, stack, tunnel_headers
from tunnel.client import ClientResponse, H3Client

pytestmark = pytest.mark.e2e

CAP = 256 * 1024
"""limits.max_queued_response_bytes for this test."""
SLOW_WINDOW = 64 * 1024
"""Credit the slow reader grants beyond what it has read."""
TOKENS = 5_000_000
"""About 11 bytes per token: a 51 MiB completion."""
BIG_BODY = orjson.dumps({"model": "mock-model", "max_tokens": TOKENS, "messages": []})
SMALL_BODY = orjson.dumps({"model": "mock-model", "stream": True, "max_tokens": 8})
PAUSE_EVERY = 64 * 1024
PAUSE_S = 0.002
OVERSHOOT = 64 * 1024 + 16 * 1024
"""The writer waits only after a write, so one engine read (httpx reads up to
64 KiB) plus its DATA frame header may land on top of the cap; the normal
request's few KiB count too."""


@dataclass
class SlowRead:
    received: int = 0
    peak_queued: int = 0
    ended: bool = False


async def trickle(response: ClientResponse, s: Stack, progress: SlowRead) -> None:
    next_pause = PAUSE_EVERY
    async for chunk in response.chunks():
        progress.received += len(chunk)
        progress.peak_queued = max(progress.peak_queued, s.pylon.tunnel.registry.queued_bytes())
        if progress.received >= next_pause:
            next_pause += PAUSE_EVERY
            await asyncio.sleep(PAUSE_S)
    progress.ended = True


async def normal_request(client: H3Client) -> bytes:
    response = await client.request("POST", CHAT, headers=tunnel_headers("normal"), body=SMALL_BODY)
    assert response.status == 200
    return await response.read()


def test_slow_consumer_is_bounded_and_does_not_starve_others(tmp_path: Path) -> None:
    async def scenario() -> None:
        limits = {"max_queued_response_bytes": CAP}
        async with stack(tmp_path, engine=MockEngineOptions(), limits=limits) as s:
            async with s.client() as client:
                slow = await client.request(
                    "POST",
                    CHAT,
                    headers=tunnel_headers("slow"),
                    body=BIG_BODY,
                    receive_window_bytes=SLOW_WINDOW,
                )
                assert slow.status == 200
                progress = SlowRead()
                reader = asyncio.ensure_future(trickle(slow, s, progress))
                while progress.received < 4 * CAP:
                    await asyncio.sleep(0.01)
                small = await normal_request(client)
                assert small.endswith(b"data: [DONE]\n\n")
                assert not progress.ended, "the slow stream ended before the normal one"
                await reader
            print(f"slow read {progress.received} bytes, peak queued {progress.peak_queued}")
            assert progress.received > 50 * 1024 * 1024
            assert progress.peak_queued <= CAP + OVERSHOOT, "a slow reader made Pylon buffer"
            assert progress.peak_queued >= CAP // 2, "the cap never engaged: reader not slow"

    run(scenario(), timeout_s=110)
