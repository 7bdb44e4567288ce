"""Who cancelled: every abnormal end is classified in the access log and the metrics.

A stream that ends without a complete response is counted once in
`pylon_cancellations_total{by}` and logged with the same `cancelled_by`:
gateway (reset or connection gone), engine (failed after the head), timeout
(a budget ran out after the head), drain (Pylon's own shutdown cut it) or
limit (one of Pylon's limits ended it after the head).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest

from backends.mock import MockEngineOptions
from pylon.errors import (
    BodyTooLarge,
    Draining,
    PylonError,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from pylon.metrics import CANCELLERS
from pylon.service import CANCELLED_BY, cancelled_by
from tests.harness import CHAT, Stack, eventually, run, stack, tunnel_headers
from tunnel.client import ClientResponse, H3Client
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

STREAM_BODY = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
ENGINE = MockEngineOptions(tokens=200, token_delay_s=0.02)
IDLE_TIMEOUT_S = 0.5


@pytest.mark.parametrize(
    ("error", "label"),
    [
        (UpstreamTimeout("idle"), "timeout"),
        (UpstreamReset("reset"), "engine"),
        (UpstreamProtocolError("bad http"), "engine"),
        (UpstreamUnreachable("gone"), "engine"),
        (Draining("draining"), "drain"),
        (BodyTooLarge("too big"), "limit"),
        (PylonError("internal"), "engine"),
    ],
)
def test_errors_after_the_head_map_to_one_canceller(error: PylonError, label: str) -> None:
    assert cancelled_by(error) == label


def test_every_canceller_label_is_a_metric_label() -> None:
    assert {label for _, label in CANCELLED_BY} | {"gateway"} <= set(CANCELLERS)


async def _started(client: H3Client, request_id: str) -> ClientResponse:
    response = await client.request(
        "POST", CHAT, headers=tunnel_headers(request_id), body=STREAM_BODY
    )
    assert response.status == 200
    return response


async def gateway_resets(s: Stack, client: H3Client) -> None:
    response = await _started(client, "cut")
    await anext(response.chunks())
    response.reset()


async def engine_crashes(s: Stack, client: H3Client) -> None:
    assert s.engine is not None
    s.engine.set_behaviour(fail_after_tokens=2)
    response = await _started(client, "cut")
    with pytest.raises(StreamAborted):
        await response.read()


async def engine_goes_silent(s: Stack, client: H3Client) -> None:
    assert s.engine is not None
    s.engine.set_behaviour(token_delay_ms=IDLE_TIMEOUT_S * 1000 * 10)
    response = await _started(client, "cut")
    with pytest.raises(StreamAborted):
        await response.read()


async def drain_runs_out(s: Stack, client: H3Client) -> None:
    response = await _started(client, "cut")
    await anext(response.chunks())
    assert not await s.pylon.drain(grace_s=0.2)
    with pytest.raises(StreamAborted):
        await response.read()


@pytest.mark.parametrize(
    ("cut", "label"),
    [
        (gateway_resets, "gateway"),
        (engine_crashes, "engine"),
        (engine_goes_silent, "timeout"),
        (drain_runs_out, "drain"),
    ],
    ids=["gateway", "engine", "timeout", "drain"],
)
def test_abnormal_end_is_classified_in_metrics_and_access_log(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    cut: Callable[[Stack, H3Client], Awaitable[None]],
    label: str,
) -> None:
    def logged() -> list[str | None]:
        return [
            getattr(r, "cancelled_by", None)
            for r in caplog.records
            if r.name == "pylon.access" and getattr(r, "request_id", None) == "cut"
        ]

    async def scenario() -> None:
        upstream = {"idle_timeout_s": IDLE_TIMEOUT_S}
        async with stack(tmp_path, engine=ENGINE, upstream=upstream) as s, s.client() as client:
            await cut(s, client)
            assert await eventually(lambda: logged() == [label], within_s=5), logged()
            counts = {
                by: s.metric("pylon_cancellations_total", backend="passthrough", by=by)
                for by in CANCELLERS
            }
            assert counts == {by: float(by == label) for by in CANCELLERS}

    with caplog.at_level(logging.INFO, logger="pylon.access"):
        run(scenario())
