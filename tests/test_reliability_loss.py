"""Packet loss on the tunnel: streamed answers and uploads arrive byte-exact anyway.

The client drops a seeded share of datagrams both ways (`tests/lossy.py`), so
Pylon's QUIC stack retransmits, probes and resends flow-control credit, and
the request-body window and response backpressure run over a lossy path.
Each streamed body is compared with the engine's direct answer; each upload
with the SHA-256 the engine recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import httpx
import orjson
import pytest

from backends.mock import MockEngineOptions
from tests.harness import CHAT, Stack, run, stack, tunnel_headers
from tests.lossy import Loss, LossyH3Client, open_lossy_client
from tunnel.client import client_configuration

pytestmark = pytest.mark.e2e

REQUESTS_PER_KIND = 50
CONCURRENCY = 10
"""Requests in flight at once: enough to keep the lossy path busy."""
STREAM_TOKENS = 40
STREAM_BODY = orjson.dumps(
    {"model": "mock-model", "stream": True, "max_tokens": STREAM_TOKENS, "messages": []}
)


def upload_body(index: int, size: int) -> bytes:
    """A distinct JSON body of about `size` bytes, so each hash checks its own bytes."""
    filler = hashlib.sha256(str(index).encode()).hexdigest() * (size // 64)
    return orjson.dumps({"model": "mock-model", "input": filler[:size]})


async def direct_stream(url: str) -> bytes:
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(
            url + CHAT, content=STREAM_BODY, headers=dict(tunnel_headers("loss-stream"))
        )
        return response.content


async def streamed(client: LossyH3Client, expected: bytes) -> None:
    response = await client.request(
        "POST", CHAT, headers=tunnel_headers("loss-stream"), body=STREAM_BODY
    )
    assert response.status == 200
    assert await response.read() == expected


async def uploaded(client: LossyH3Client, s: Stack, index: int, size: int) -> None:
    body = upload_body(index, size)
    request_id = f"loss-upload-{index}"
    response = await client.request(
        "POST", "/v1/embeddings", headers=tunnel_headers(request_id), body=body
    )
    assert response.status == 200
    assert orjson.loads(await response.read())["object"] == "list"
    assert s.engine is not None
    (record,) = [r for r in s.engine.snapshot()["requests"] if r["x_request_id"] == request_id]
    assert record["body_bytes"] == len(body)
    assert record["body_sha256"] == hashlib.sha256(body).hexdigest()


async def bounded_gather(jobs: list[Callable[[], Awaitable[None]]]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(job) for job in jobs))


@pytest.mark.parametrize(
    ("rate", "upload_bytes"),
    # aioquic recovers at roughly 300 KB/s under 15% loss on loopback (every
    # tail loss waits out a PTO), so the heavier loss sends half-size uploads:
    # each still spans about a hundred packets, and the run stays near 20 s.
    [(0.05, 256 * 1024), (0.15, 128 * 1024)],
    ids=["5pct", "15pct"],
)
def test_streams_and_uploads_survive_packet_loss(
    tmp_path: Path, rate: float, upload_bytes: int
) -> None:
    async def scenario() -> None:
        engine = MockEngineOptions(tokens=STREAM_TOKENS)
        async with stack(tmp_path, engine=engine) as s:
            assert s.engine is not None
            expected = await direct_stream(s.engine.url)
            loss = Loss(rate=rate, seed=6)
            configuration = client_configuration(verify=False)
            async with open_lossy_client(
                "127.0.0.1", s.pylon.port, configuration=configuration, loss=loss
            ) as client:
                jobs: list[Callable[[], Awaitable[None]]] = []
                for index in range(REQUESTS_PER_KIND):
                    jobs.append(lambda: streamed(client, expected))
                    jobs.append(partial(uploaded, client, s, index, upload_bytes))
                await bounded_gather(jobs)
            assert loss.dropped_out > 0 and loss.dropped_in > 0, "no loss was injected"
            print(f"loss {rate:.0%}: {loss}")

    run(scenario(), timeout_s=100)


def test_uploads_through_a_small_request_window_survive_packet_loss(tmp_path: Path) -> None:
    """Body reads wait for a batch (a quarter of the window); with losses, a gap can
    leave the peer blocked short of one, and flow control must hand the read over."""

    async def scenario() -> None:
        async with stack(tmp_path, limits={"request_window_bytes": 16 * 1024}) as s:
            loss = Loss(rate=0.10, seed=11)
            configuration = client_configuration(verify=False)
            async with open_lossy_client(
                "127.0.0.1", s.pylon.port, configuration=configuration, loss=loss
            ) as client:
                jobs: list[Callable[[], Awaitable[None]]] = [
                    partial(uploaded, client, s, index, 96 * 1024) for index in range(6)
                ]
                await bounded_gather(jobs)
            assert loss.dropped_out > 0, "no loss was injected"

    run(scenario(), timeout_s=100)
