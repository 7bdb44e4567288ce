"""Each backend end to end against its mock engine: the spoof matrix, the kill switch,
health requests, closed routes, and priority taking effect in the engine's own queue."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.base import BackendAdapter
from backends.mock import MockEngineOptions
from backends.priority import PriorityPolicy
from backends.registry import build_adapter
from pylon.config import Settings
from tests.harness import CHAT, Stack, run, stack, tunnel_headers

pytestmark = pytest.mark.e2e

BACKENDS: dict[str, dict[str, Any]] = {
    "dynamo": {"type": "dynamo"},
    "vllm": {"type": "vllm"},
    "sglang": {"type": "sglang", "priority_scheduling": True, "scale": 2},
}
CEILING = 1000
PLATFORM_PRIORITY = 3


def _adapter(backend: str) -> BackendAdapter:
    settings = Settings(backend=BACKENDS[backend])
    return build_adapter(settings.backend, PriorityPolicy(ceiling=CEILING))


def _casings(name: str) -> list[str]:
    return [name, name.upper(), name.title()]


def spoof_headers(adapter: BackendAdapter, value: str) -> list[tuple[str, str]]:
    """Every deny-listed and derived name, in three casings, each sent twice."""
    names = sorted(adapter.all_denied_headers() | adapter.derived_header_names())
    names += [prefix + "spoof" for prefix in adapter.all_denied_header_prefixes()]
    return [(cased, value) for name in names for cased in _casings(name) for _ in range(2)]


def spoof_body(adapter: BackendAdapter, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "mock-model", "messages": []}
    for path in adapter.all_denied_body_fields():
        target = body
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
    return body


def _record(s: Stack, method: str, path: str) -> dict[str, Any]:
    assert s.engine is not None
    records = [r for r in s.engine.snapshot()["requests"] if r["path"] == path]
    assert [r["method"] for r in records] == [method], records
    return records[0]


def expected_priority_inputs(backend: str, platform_priority: int) -> dict[str, Any]:
    level = min(platform_priority, CEILING)
    if backend == "dynamo":
        return {
            "headers": {
                "x-dynamo-request-priority": [str(CEILING - level)],
                "x-dynamo-request-strict-priority": ["0"],
            },
            "body": {},
        }
    if backend == "vllm":
        return {"headers": {}, "body": {"priority": level}}
    return {"headers": {}, "body": {"priority": (CEILING - level) * 2}}


def _assert_nothing_spoofed_arrived(record: dict[str, Any], adapter: BackendAdapter) -> None:
    received = {name for name, _ in record["headers"]}
    denied = adapter.all_denied_headers()
    prefixes = adapter.all_denied_header_prefixes()
    leaked = {n for n in received if n in denied or n.startswith(prefixes)}
    assert leaked == set(), f"deny-listed headers reached the engine: {leaked}"
    routing = record["routing_inputs"]
    assert routing.get("body", {}) == {}
    assert set(routing.get("headers", {})) <= {"x-request-id"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spoof", ["4294967295", "-7", "not-a-number"])
def test_spoof_matrix_only_pylons_values_reach_the_engine(
    tmp_path: Path, backend: str, spoof: str
) -> None:
    adapter = _adapter(backend)
    body_value: Any = int(spoof) if spoof.lstrip("-").isdigit() else spoof

    async def scenario() -> None:
        engine = MockEngineOptions(engine=backend)
        async with stack(tmp_path, engine=engine, backend=BACKENDS[backend]) as s, s.client() as c:
            headers = tunnel_headers("spoof-1", x_priority=str(PLATFORM_PRIORITY))
            response = await c.request(
                "POST",
                CHAT,
                headers=headers + spoof_headers(adapter, spoof),
                body=orjson.dumps(spoof_body(adapter, body_value)),
            )
            assert response.status == 200, await response.read()
            await response.read()
            record = _record(s, "POST", CHAT)
            assert record["priority_inputs"] == expected_priority_inputs(backend, PLATFORM_PRIORITY)
            _assert_nothing_spoofed_arrived(record, adapter)
            assert record["x_request_id"] == "spoof-1"
            stripped = s.metric(
                "pylon_stripped_total",
                backend=backend,
                kind="body",
                name=".".join(adapter.all_denied_body_fields()[0]),
            )
            assert stripped == 1

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_switch_stops_derivation_but_not_the_strip(tmp_path: Path, backend: str) -> None:
    adapter = _adapter(backend)

    async def scenario() -> None:
        engine = MockEngineOptions(engine=backend)
        async with (
            stack(tmp_path, engine=engine, backend=BACKENDS[backend], derive_priority=False) as s,
            s.client() as c,
        ):
            headers = tunnel_headers("off-1", x_priority="0") + spoof_headers(adapter, "1")
            response = await c.request(
                "POST", CHAT, headers=headers, body=orjson.dumps(spoof_body(adapter, 1))
            )
            assert response.status == 200
            await response.read()
            record = _record(s, "POST", CHAT)
            assert record["priority_inputs"] == {"headers": {}, "body": {}}
            _assert_nothing_spoofed_arrived(record, adapter)
            outcome = s.metric(
                "pylon_priority_derivations_total", backend=backend, outcome="disabled"
            )
            assert outcome == 1

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_health_gets_no_priority_and_is_still_stripped(tmp_path: Path, backend: str) -> None:
    adapter = _adapter(backend)

    async def scenario() -> None:
        engine = MockEngineOptions(engine=backend)
        async with stack(tmp_path, engine=engine, backend=BACKENDS[backend]) as s, s.client() as c:
            assert s.engine is not None
            s.engine.clear()
            response = await c.request(
                "GET",
                "/health",
                headers=[
                    ("x-priority", "0"),
                    ("x-test-marker", "health-1"),
                    *spoof_headers(adapter, "1"),
                ],
            )
            assert response.status == 200
            await response.read()
            record = [
                r
                for r in s.engine.snapshot()["requests"]
                if ["x-test-marker", "health-1"] in r["headers"]
            ]
            assert record, "the tunneled health request never reached the engine"
            received = {name for name, _ in record[-1]["headers"]}
            assert received.isdisjoint(adapter.derived_header_names()), "health got a priority"
            assert record[-1]["priority_inputs"].get("headers", {}) == {}
            _assert_nothing_spoofed_arrived(record[-1], adapter)

    run(scenario())


ADMIN_ROUTES = [
    ("POST", "/flush_cache"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/sleep"),
    ("POST", "/collective_rpc"),
    ("GET", "/busy_threshold"),
    ("GET", "/metrics"),
    ("POST", "/start_profile"),
    ("GET", "/server_info"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_admin_routes_answer_404_without_touching_the_engine(
    tmp_path: Path, backend: str
) -> None:
    async def scenario() -> None:
        engine = MockEngineOptions(engine=backend)
        async with stack(tmp_path, engine=engine, backend=BACKENDS[backend]) as s, s.client() as c:
            assert s.engine is not None
            for method, path in ADMIN_ROUTES:
                response = await c.request(method, path, headers=tunnel_headers("adm"), body=b"{}")
                error = orjson.loads(await response.read())
                assert response.status == 404, path
                assert error["error"]["code"] == "route_not_allowed"
            assert s.engine.snapshot()["admin_calls"] == []

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_urgent_requests_overtake_in_a_saturated_engine(tmp_path: Path, backend: str) -> None:
    """One slot busy; queued in least-urgent-first order; the engine serves most urgent first."""
    arrivals = [("unconfigured", None), ("p500", "500"), ("p100", "100"), ("p0", "0")]

    async def scenario() -> None:
        engine = MockEngineOptions(engine=backend, slots=1, tokens=2, token_delay_s=0.05)
        async with stack(tmp_path, engine=engine, backend=BACKENDS[backend]) as s, s.client() as c:
            assert s.engine is not None

            async def send(request_id: str, priority: str | None, tokens: int) -> int:
                extra = {"x_priority": priority} if priority is not None else {}
                body = {"model": "mock-model", "messages": [], "max_tokens": tokens}
                response = await c.request(
                    "POST",
                    CHAT,
                    headers=tunnel_headers(request_id, **extra),
                    body=orjson.dumps(body),
                )
                await response.read()
                return response.status

            blocker = asyncio.ensure_future(send("blocker", "0", 20))
            await asyncio.sleep(0.2)
            queued = []
            for request_id, priority in arrivals:
                queued.append(asyncio.ensure_future(send(request_id, priority, 2)))
                await asyncio.sleep(0.02)
            statuses = await asyncio.gather(blocker, *queued)
            assert statuses == [200] * 5, "unconfigured traffic must still complete"
            order = [rid for rid in s.engine.snapshot()["started_order"] if rid != "blocker"]
            assert order == ["p0", "p100", "p500", "unconfigured"]

    run(scenario())


def test_emitted_priority_is_logged_at_debug_with_the_request_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        engine = MockEngineOptions(engine="dynamo")
        async with stack(tmp_path, engine=engine, backend=BACKENDS["dynamo"]) as s, s.client() as c:
            response = await c.request(
                "POST",
                CHAT,
                headers=tunnel_headers("log-7", x_priority="3"),
                body=orjson.dumps({"model": "mock-model", "messages": []}),
            )
            await response.read()

    with caplog.at_level("DEBUG", logger="pylon.priority"):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "pylon.priority"]
    assert any("997" in line and "log-7" in line for line in lines), lines
