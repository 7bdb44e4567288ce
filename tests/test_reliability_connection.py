"""Long-lived tunnel connections: keep-alive PINGs, dead peers, memory flat over many requests.

A gateway connection lives for days, so a quiet connection must stay open
(Pylon PINGs it), a vanished peer must be noticed and its state freed, and
thousands of requests on one connection must not grow the tunnel layer.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from backends.mock import MockEngineOptions
from tests.harness import CHAT, Stack, eventually, run, stack, tunnel_headers
from tests.lossy import Loss, open_lossy_client
from tunnel.client import H3Client, client_configuration, open_client
from tunnel.server import TunnelProtocol

pytestmark = pytest.mark.e2e

CHAT_BODY = orjson.dumps({"model": "mock-model", "messages": []})
STREAM_BODY = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
CLIENT_IDLE_TIMEOUT_S = 1.0
"""The client's QUIC idle timeout; the connection's is the smaller of both ends'."""


def only_connection(s: Stack) -> TunnelProtocol:
    (protocol,) = s.pylon.tunnel.registry.connections
    return protocol


async def chat(client: H3Client, request_id: str, body: bytes = CHAT_BODY) -> None:
    response = await client.request("POST", CHAT, headers=tunnel_headers(request_id), body=body)
    assert response.status == 200
    await response.read()


@pytest.mark.parametrize("ping_interval_s", [0.2, 0.0], ids=["pings", "no-pings"])
def test_keepalive_holds_a_quiet_connection_open(tmp_path: Path, ping_interval_s: float) -> None:
    """Quiet for three client idle timeouts: Pylon's PINGs keep it open; without them it closes."""

    async def scenario() -> None:
        configuration = client_configuration(verify=False)
        configuration.idle_timeout = CLIENT_IDLE_TIMEOUT_S
        async with (
            stack(tmp_path, quic_ping_interval_s=ping_interval_s) as s,
            open_client("127.0.0.1", s.pylon.port, configuration=configuration) as client,
        ):
            await chat(client, "before")
            protocol = only_connection(s)
            closed = asyncio.ensure_future(client.wait_closed())
            await asyncio.wait({closed}, timeout=3 * CLIENT_IDLE_TIMEOUT_S)
            if ping_interval_s:
                assert not closed.done(), "a quiet connection was closed despite keep-alive"
                assert protocol.keepalive_pings_sent >= 2
                await chat(client, "after")
            else:
                assert closed.done(), "the idle timeout should have closed the connection"
                assert protocol.keepalive_pings_sent == 0
                assert await eventually(lambda: not s.pylon.tunnel.registry.connections, within_s=5)
            closed.cancel()

    run(scenario())


def test_vanished_peer_is_detected_and_its_request_cancelled(tmp_path: Path) -> None:
    """The gateway disappears mid-stream (every datagram lost): the connection and the
    engine request end within the idle timeout, counted as cancelled by the gateway."""

    async def scenario() -> None:
        engine = MockEngineOptions(tokens=1000, token_delay_s=0.05)
        loss = Loss(rate=0.0)
        configuration = client_configuration(verify=False)
        async with (
            stack(tmp_path, engine=engine, quic_idle_timeout_s=1.0, quic_ping_interval_s=0.3) as s,
            open_lossy_client(
                "127.0.0.1", s.pylon.port, configuration=configuration, loss=loss
            ) as client,
        ):
            assert s.engine is not None
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("vanish"), body=STREAM_BODY
            )
            await anext(response.chunks())
            loss.rate = 1.0  # the peer is gone: nothing arrives, nothing is answered
            registry = s.pylon.tunnel.registry
            assert await eventually(lambda: not registry.connections, within_s=10)
            engine_ref = s.engine
            assert await eventually(
                lambda: "vanish" in str(engine_ref.snapshot()["aborted"]), within_s=5
            )
            assert s.metric("pylon_cancellations_total", backend="passthrough", by="gateway") == 1

    run(scenario())


TOTAL_REQUESTS = 3000
BASELINE_AT = 1000
CONCURRENCY = 8
LAYERS = ("tunnel.", "pylon.", "aioquic.")
"""Modules whose objects are counted: Pylon's tunnel and service code, and aioquic."""
MAX_LAYER_OBJECT_GROWTH = 50
MAX_OBJECT_GROWTH = 500
MAX_BLOCK_GROWTH = 1000
"""Run to run, the event loop's timer heap alone moves these counts by ~200;
a leak of one object per request would add 2000."""


@dataclass(frozen=True)
class Census:
    layer_objects: Counter[str]
    """Live objects of tunnel, pylon and aioquic types, by type name."""
    objects: int
    """Every object the garbage collector tracks."""
    blocks: int
    """Memory blocks the interpreter holds (`sys.getallocatedblocks`)."""


def in_layers(cls: type) -> bool:
    module = cls.__dict__.get("__module__", "")  # some C types expose a descriptor here
    return isinstance(module, str) and module.startswith(LAYERS)


def census(s: Stack) -> Census:
    """Counts after a full collection; the mock engine's own request history is cleared first.

    Object counts rather than tracemalloc: tracing every allocation makes each
    request about eight times slower, and these counts catch the same leaks.
    """
    assert s.engine is not None
    s.engine.clear()
    gc.collect()
    objects = gc.get_objects()
    layer = Counter(type(obj).__qualname__ for obj in objects if in_layers(type(obj)))
    return Census(layer, len(objects), sys.getallocatedblocks())


async def run_requests(client: H3Client, first: int, last: int) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(index: int) -> None:
        async with gate:
            await chat(client, f"m-{index}", STREAM_BODY if index % 2 else CHAT_BODY)

    await asyncio.gather(*(one(index) for index in range(first, last)))


def test_memory_is_flat_over_thousands_of_requests_on_one_connection(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path, engine=MockEngineOptions(tokens=4)) as s, s.client() as client:
            await run_requests(client, 0, BASELINE_AT)
            await client.ping()  # every ACK in, so no stream waits on one
            before = census(s)
            await run_requests(client, BASELINE_AT, TOTAL_REQUESTS)
            await client.ping()
            after = census(s)
            layer_growth = after.layer_objects - before.layer_objects
            objects, blocks = after.objects - before.objects, after.blocks - before.blocks
            print(f"objects {objects:+d}, blocks {blocks:+d}, layer types grown {layer_growth}")
            assert only_connection(s).tracked_state_count() == 0
            assert sum(layer_growth.values()) <= MAX_LAYER_OBJECT_GROWTH, layer_growth
            assert objects <= MAX_OBJECT_GROWTH
            assert blocks <= MAX_BLOCK_GROWTH

    run(scenario(), timeout_s=110)
