"""Tests of the mock engines (backends/mock): wire format, per-engine priority rules,
test-control, disconnect detection, crash emulation and queue order.

Every test runs a real MockEngine on port 0 and talks to it with httpx (or a
raw socket), using plain `asyncio.run` so no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import pytest

from backends.mock import ENGINE_FLAVOURS, MockEngine, MockEngineOptions
from backends.mock.flavours import Resolution
from backends.mock.inputs import I32, U32, parse_rust_int
from backends.mock.queue import ORDERING, Waiting

CHAT = "/v1/chat/completions"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


@contextlib.asynccontextmanager
async def engine_client(**options: Any) -> AsyncIterator[tuple[MockEngine, httpx.AsyncClient]]:
    engine = MockEngine(MockEngineOptions(**options))
    await engine.start()
    try:
        async with httpx.AsyncClient(base_url=engine.url, timeout=5.0) as client:
            yield engine, client
    finally:
        await engine.close()


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 1.0) -> float:
    """Poll until predicate() holds; returns the time it took, fails on timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def queued(engine: MockEngine, count: int) -> Callable[[], bool]:
    return lambda: bool(engine.snapshot()["queued"] == count)


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


# --- wire format ----------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINE_FLAVOURS)
def test_streaming_sse_framing_ends_with_done(engine: str) -> None:
    async def scenario() -> None:
        async with engine_client(engine=engine, tokens=3) as (_, client):
            body = {"model": "m", "stream": True}
            async with client.stream("POST", CHAT, json=body) as resp:
                raw = (await resp.aread()).decode()
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream"
            assert resp.headers["transfer-encoding"] == "chunked"
            assert "content-length" not in resp.headers
            assert raw.endswith("data: [DONE]\n\n")
            assert raw.startswith(": keep-alive\n\n") == (engine == "vllm")
            frames = sse_data(raw)
            assert frames[-1] == "[DONE]"
            chunks = [json.loads(f) for f in frames[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert text == "tok0 tok1 tok2"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    run(scenario())


def test_streaming_paces_tokens_with_delay() -> None:
    async def scenario() -> None:
        async with engine_client(tokens=4, token_delay_s=0.03) as (_, client):
            started = time.monotonic()
            resp = await client.post(CHAT, json={"stream": True})
            # Four paced gaps; the loop's millisecond timers may each fire a tick early.
            assert time.monotonic() - started >= 0.12 - 4 * 0.001
            assert len(sse_data(resp.text)) == 4 + 2

    run(scenario())


@pytest.mark.parametrize(
    ("engine", "path", "body", "check"),
    [
        ("openai", CHAT, {"model": "m"}, lambda j: j["choices"][0]["message"]["content"]),
        ("vllm", "/v1/completions", {"prompt": "x"}, lambda j: j["choices"][0]["text"]),
        ("dynamo", "/v1/responses", {"input": "x"}, lambda j: j["output"][0]["content"][0]["text"]),
        ("sglang", "/generate", {"text": "x"}, lambda j: j["text"]),
    ],
)
def test_non_streaming_completion(
    engine: str, path: str, body: dict[str, Any], check: Callable[[Any], str]
) -> None:
    async def scenario() -> None:
        async with engine_client(engine=engine, tokens=3) as (_, client):
            resp = await client.post(path, json=body, headers={"x-request-id": "r1"})
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "application/json"
            assert check(resp.json()) == "tok0 tok1 tok2"
            resp = await client.post(path, json={**body, "max_tokens": 2})
            assert check(resp.json()) == "tok0 tok1"

    run(scenario())


def test_chat_id_derives_from_request_id_and_is_echoed() -> None:
    async def scenario() -> None:
        async with engine_client(engine="dynamo") as (_, client):
            resp = await client.post(CHAT, json={"model": "m"}, headers={"x-request-id": "abc"})
            assert resp.json()["id"] == "chatcmpl-abc"
            assert resp.headers["x-request-id"] == "abc"

    run(scenario())


def test_models_embeddings_and_health() -> None:
    async def scenario() -> None:
        async with engine_client(engine="vllm") as (_, client):
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["mock-model"]
            emb = (await client.post("/v1/embeddings", json={"input": ["a", "b"]})).json()
            vectors = [d["embedding"] for d in emb["data"]]
            assert len(vectors) == 2 and vectors[0] != vectors[1]
            again = (await client.post("/v1/embeddings", json={"input": ["a"]})).json()
            assert again["data"][0]["embedding"] == vectors[0]
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ping")).status_code == 200
            assert (await client.get("/live")).status_code == 404  # a Dynamo route

    run(scenario())


@pytest.mark.parametrize(
    ("engine", "path", "status"),
    [
        ("dynamo", "/live", 200),
        ("dynamo", "/generate", 404),
        ("sglang", "/generate", 405),  # GET on a POST route
        ("sglang", "/health_generate", 200),
        ("sglang", "/ready", 200),
        ("sglang", "/v1/responses", 404),
        ("vllm", "/ping", 200),
    ],
)
def test_routes_per_flavour(engine: str, path: str, status: int) -> None:
    async def scenario() -> None:
        async with engine_client(engine=engine) as (_, client):
            assert (await client.get(path)).status_code == status

    run(scenario())


def test_keep_alive_and_pipelining_on_one_connection() -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions())
        await engine.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
        try:
            one = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
            writer.write(one + one + one)
            data = b""
            while data.count(b"HTTP/1.1 200") < 3:
                chunk = await asyncio.wait_for(reader.read(65536), 2.0)
                assert chunk, "server closed the kept-alive connection"
                data += chunk
        finally:
            writer.close()
            await writer.wait_closed()
            await engine.close()
        assert len(engine.snapshot()["requests"]) == 3

    run(scenario())


# --- priority resolution ------------------------------------------------------------

H = list[tuple[str, str]]

PRIORITY_TABLE: list[tuple[str, dict[str, Any], H, dict[str, Any], int | None, str]] = [
    # Dynamo: a well-formed header wins (0 and negatives included), trimmed, i32.
    ("dynamo", {}, [("x-dynamo-request-priority", "7")], {"p": 3}, 7, "header"),
    ("dynamo", {}, [("x-dynamo-request-priority", "0")], {"p": 9}, 0, "header"),
    ("dynamo", {}, [("x-dynamo-request-priority", "-3")], {"p": 9}, -3, "header"),
    ("dynamo", {}, [("x-dynamo-request-priority", "+4")], {"p": 9}, 4, "header"),
    # malformed header -> body
    ("dynamo", {}, [("x-dynamo-request-priority", "abc")], {"p": 3}, 3, "body"),
    ("dynamo", {}, [("x-dynamo-request-priority", "7.5")], {"p": 3}, 3, "body"),
    ("dynamo", {}, [("x-dynamo-request-priority", "5, 7")], {"p": 3}, 3, "body"),
    ("dynamo", {}, [("x-dynamo-request-priority", "2147483648")], {"p": 3}, 3, "body"),
    ("dynamo", {}, [("x-dynamo-request-priority", "")], {}, None, "none"),
    # repeated: the first value counts, even when it is malformed
    ("dynamo", {}, [("x-dynamo-request-priority", "4"), ("x-dynamo-request-priority", "8")],
     {}, 4, "header"),
    ("dynamo", {}, [("x-dynamo-request-priority", "x"), ("x-dynamo-request-priority", "8")],
     {"p": 2}, 2, "body"),
    # vLLM: body priority (default 0); an int header overrides; fcfs ignores both.
    ("vllm", {}, [], {"priority": 3}, 3, "body"),
    ("vllm", {}, [("x-vllm-priority", "5")], {"priority": 3}, 5, "header"),
    ("vllm", {}, [("x-vllm-priority", "-2")], {}, -2, "header"),
    ("vllm", {}, [("x-vllm-priority", "high")], {"priority": 3}, 3, "body"),
    ("vllm", {}, [("x-vllm-priority", "2"), ("x-vllm-priority", "9")], {}, 2, "header"),
    ("vllm", {}, [], {}, 0, "default"),
    ("vllm", {"vllm_scheduling_policy": "fcfs"}, [("x-vllm-priority", "5")],
     {"priority": 3}, None, "ignored"),
    # SGLang: body priority; x-override-priority only when overrides are enabled.
    ("sglang", {}, [], {"priority": 5}, 5, "body"),
    ("sglang", {}, [("x-override-priority", "9")], {"priority": 5}, 5, "body"),
    ("sglang", {"sglang_header_overrides": True}, [("x-override-priority", "9")],
     {"priority": 5}, 9, "header"),
    ("sglang", {}, [], {}, None, "none"),
    ("sglang", {"sglang_default_priority": 50}, [], {}, 50, "default"),
    ("sglang", {"sglang_priority_scheduling": False}, [], {"priority": 5}, None, "ignored"),
    ("sglang", {"sglang_priority_scheduling": False, "sglang_abort_on_priority_when_disabled":
                True}, [], {}, None, "ignored"),
    # The generic server resolves nothing.
    ("openai", {}, [("x-dynamo-request-priority", "5")], {"priority": 3}, None, "none"),
]  # fmt: skip


def _body(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    """`{"p": n}` is Dynamo's nvext.agent_hints.priority; other keys are top-level."""
    body: dict[str, Any] = {"model": "m"}
    if "p" in spec:
        body["nvext"] = {"agent_hints": {"priority": spec["p"]}}
    body.update({k: v for k, v in spec.items() if k != "p"})
    return body


@pytest.mark.parametrize(
    ("engine", "options", "headers", "body", "priority", "source"), PRIORITY_TABLE
)
def test_priority_resolution(
    engine: str,
    options: dict[str, Any],
    headers: H,
    body: dict[str, Any],
    priority: int | None,
    source: str,
) -> None:
    async def scenario() -> None:
        async with engine_client(engine=engine, **options) as (eng, client):
            resp = await client.post(CHAT, json=_body(engine, body), headers=headers)
            assert resp.status_code == 200, resp.text
            record = eng.snapshot()["latest"][f"POST {CHAT}"]["m"]
            assert record["resolved"]["priority"] == priority
            assert record["resolved"]["source"] == source

    run(scenario())


def test_priority_inputs_are_recorded_with_every_value() -> None:
    async def scenario() -> None:
        async with engine_client() as (eng, client):
            headers = [("x-vllm-priority", "1"), ("x-vllm-priority", "2"), ("x-tenant-id", "t")]
            body = {"model": "m", "priority": 3, "cache_salt": "s"}
            await client.post(CHAT, json=body, headers=headers)
            record = eng.snapshot()["latest"][f"POST {CHAT}"]["m"]
            assert record["priority_inputs"]["headers"] == {"x-vllm-priority": ["1", "2"]}
            assert record["priority_inputs"]["body"] == {"priority": 3}
            assert record["routing_inputs"]["headers"] == {"x-tenant-id": ["t"]}
            assert record["routing_inputs"]["body"] == {"cache_salt": "s"}

    run(scenario())


@pytest.mark.parametrize(
    ("headers", "hints", "strict", "jump"),
    [
        ([("x-dynamo-request-strict-priority", "1")], {"strict_priority": 2}, 1, None),
        ([("x-dynamo-request-strict-priority", "-1")], {"strict_priority": 2}, 2, None),
        ([], {"latency_sensitivity": 0.5}, None, 0.5),
        ([("x-dynamo-request-priority", "1")], {"latency_sensitivity": 0.5}, None, None),
    ],
)
def test_dynamo_strict_tier_and_latency_jump(
    headers: H, hints: dict[str, Any], strict: int | None, jump: float | None
) -> None:
    async def scenario() -> None:
        async with engine_client(engine="dynamo") as (eng, client):
            body = {"model": "m", "nvext": {"agent_hints": hints}}
            assert (await client.post(CHAT, json=body, headers=headers)).status_code == 200
            resolved = eng.snapshot()["latest"][f"POST {CHAT}"]["m"]["resolved"]
            assert (resolved["strict_priority"], resolved["jump"]) == (strict, jump)

    run(scenario())


@pytest.mark.parametrize(
    ("options", "headers", "body"),
    [
        ({}, [], {"priority": 5}),
        ({"sglang_header_overrides": True}, [("x-override-priority", "5")], {}),
    ],
)
def test_sglang_aborts_priority_when_disabled(
    options: dict[str, Any], headers: H, body: dict[str, Any]
) -> None:
    async def scenario() -> None:
        opts = {"sglang_priority_scheduling": False, "sglang_abort_on_priority_when_disabled": True}
        async with engine_client(engine="sglang", **opts, **options) as (_, client):
            resp = await client.post(CHAT, json=body, headers=headers)
            assert resp.status_code == 503
            assert resp.json()["object"] == "error" and resp.json()["code"] == 503

    run(scenario())


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "priority": 1},  # a vLLM-style top-level priority is not a channel
        {"model": "m", "nvext": {"not_a_key": 1}},
        {"model": "m", "nvext": {"agent_hints": {"priority": "high"}}},
    ],
)
def test_dynamo_rejects_unknown_fields(body: dict[str, Any]) -> None:
    async def scenario() -> None:
        async with engine_client(engine="dynamo") as (_, client):
            resp = await client.post(CHAT, json=body)
            assert resp.status_code == 400
            assert set(resp.json()) == {"message", "type", "code"}

    run(scenario())


def test_dynamo_accepts_known_nvext_keys() -> None:
    async def scenario() -> None:
        async with engine_client(engine="dynamo") as (_, client):
            nvext = {"backend_instance_id": 3, "cache_salt": "s", "agent_hints": {"priority": 1}}
            resp = await client.post(CHAT, json={"model": "m", "nvext": nvext, "cache_salt": "t"})
            assert resp.status_code == 200

    run(scenario())


# --- error shapes ------------------------------------------------------------------

ERROR_KEYS = {
    "dynamo": {"message", "type", "code"},
    "vllm": {"error"},
    "openai": {"error"},
    "sglang": {"object", "message", "type", "param", "code"},
}


@pytest.mark.parametrize("engine", ENGINE_FLAVOURS)
@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [("POST", CHAT, b"{not json", 400), ("GET", "/no/such/route", b"", 404)],
)
def test_error_shapes(engine: str, method: str, path: str, content: bytes, status: int) -> None:
    async def scenario() -> None:
        async with engine_client(engine=engine) as (_, client):
            resp = await client.request(method, path, content=content)
            assert resp.status_code == status
            body = resp.json()
            assert set(body) == ERROR_KEYS[engine]
            inner = body.get("error", body)
            assert inner["code"] == status and inner["message"]
            if "error" in body:
                assert set(inner) == {"message", "type", "param", "code"}

    run(scenario())


# --- recording and test-control --------------------------------------------------------


def test_records_headers_and_large_body_byte_exact() -> None:
    async def scenario() -> None:
        async with engine_client() as (eng, client):
            payload = json.dumps({"model": "big", "prompt": "x" * (3 * 1024 * 1024)}).encode()
            headers = [("x-request-id", "rid-1"), ("x-dup", "a"), ("X-Dup", "b")]
            resp = await client.post("/v1/completions", content=payload, headers=headers)
            assert resp.status_code == 200
            record = eng.snapshot()["latest"]["POST /v1/completions"]["big"]
            assert record["body_bytes"] == len(payload)
            assert record["body_sha256"] == hashlib.sha256(payload).hexdigest()
            assert record["x_request_id"] == "rid-1"
            assert [v for k, v in record["headers"] if k == "x-dup"] == ["a", "b"]
            assert record["arrival_s"] <= record["start_s"] <= record["finish_s"]

    run(scenario())


def test_test_control_get_delete_put() -> None:
    async def scenario() -> None:
        async with engine_client(engine="sglang", tokens=2) as (eng, client):
            await client.post(CHAT, json={"model": "a"})
            await client.post("/flush_cache")
            snap = (await client.get("/test-control")).json()
            assert snap == eng.snapshot()
            assert [r["path"] for r in snap["requests"]] == [CHAT, "/flush_cache"]
            assert snap["admin_calls"] == ["/flush_cache"]
            assert snap["started_order"] == [snap["requests"][0]["request_id"]]
            assert (await client.delete("/test-control")).status_code == 200
            snap = (await client.get("/test-control")).json()
            assert snap["requests"] == [] and snap["latest"] == {} and snap["admin_calls"] == []

            put = await client.put("/test-control", json={"tokens": 4, "health_status": 503})
            assert put.status_code == 200
            resp = await client.post(CHAT, json={})
            assert resp.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3"
            assert (await client.get("/health")).status_code == 503
            await client.put("/test-control", json={"status_override": 529})
            resp = await client.post(CHAT, json={})
            assert resp.status_code == 529 and resp.json()["object"] == "error"
            await client.put("/test-control", json={"reset": True})
            assert (await client.post(CHAT, json={})).status_code == 200
            assert (await client.put("/test-control", json={"bogus": 1})).status_code == 400
            assert (await client.put("/test-control", json={"tokens": -1})).status_code == 400
            paths = [r["path"] for r in eng.snapshot()["requests"]]
            assert "/test-control" not in paths

    run(scenario())


def test_set_behaviour_method_matches_put() -> None:
    async def scenario() -> None:
        async with engine_client() as (eng, client):
            eng.set_behaviour(tokens=1, token_delay_ms=0)
            resp = await client.post(CHAT, json={})
            assert resp.json()["choices"][0]["message"]["content"] == "tok0"
            eng.clear()
            assert eng.snapshot()["requests"] == []
            with pytest.raises(ValueError):
                eng.set_behaviour(nope=1)

    run(scenario())


# --- disconnects, crashes, close -----------------------------------------------------


def test_client_disconnect_mid_stream_is_recorded_promptly() -> None:
    async def scenario() -> None:
        async with engine_client(tokens=1000, token_delay_s=0.01) as (eng, client):
            headers = {"x-request-id": "gone"}
            async with client.stream("POST", CHAT, json={"stream": True}, headers=headers) as r:
                async for _ in r.aiter_bytes():
                    break
            took = await wait_for(lambda: eng.snapshot()["aborted"] == ["gone"], timeout_s=1.0)
            assert took < 1.0
            record = eng.snapshot()["requests"][0]
            assert record["aborted"] and record["tokens_sent"] < 1000

    run(scenario())


def test_client_disconnect_while_queued_is_recorded_and_frees_nothing() -> None:
    async def scenario() -> None:
        async with engine_client(slots=0) as (eng, client):
            task = asyncio.create_task(client.post(CHAT, json={}, headers={"x-request-id": "q"}))
            await wait_for(lambda: eng.snapshot()["queued"] == 1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await wait_for(lambda: eng.snapshot()["aborted"] == ["q"])
            assert eng.snapshot()["queued"] == 0 and eng.snapshot()["started_order"] == []

    run(scenario())


def test_fail_after_tokens_closes_connection_mid_stream() -> None:
    async def scenario() -> None:
        async with engine_client(tokens=10) as (eng, client):
            eng.set_behaviour(fail_after_tokens=2)
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", CHAT, json={"stream": True}) as resp:
                    async for chunk in resp.aiter_bytes():
                        received += chunk
            frames = sse_data(received.decode())
            assert len(frames) == 2 and "[DONE]" not in frames
            eng.set_behaviour(fail_after_tokens=None)
            resp = await client.post(CHAT, json={"stream": True})
            assert sse_data(resp.text)[-1] == "[DONE]"

    run(scenario())


def test_close_aborts_open_streams_promptly() -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=1000, token_delay_s=0.01))
        await engine.start()
        async with (
            httpx.AsyncClient(base_url=engine.url) as client,
            client.stream("POST", CHAT, json={"stream": True}) as resp,
        ):
            started = time.monotonic()
            await engine.close()
            with pytest.raises(httpx.RemoteProtocolError):
                await resp.aread()
            assert time.monotonic() - started < 0.5

    run(scenario())


# --- queue order ------------------------------------------------------------------

QUEUE_CASES: list[tuple[str, dict[str, Any], list[tuple[str, H, dict[str, Any]]], list[str]]] = [
    ("openai", {}, [("a", [], {"priority": 9}), ("b", [], {}), ("c", [], {"priority": 1})],
     ["a", "b", "c"]),
    ("dynamo", {}, [
        ("a", [], {}),
        ("b", [("x-dynamo-request-priority", "5")], {}),
        ("c", [("x-dynamo-request-priority", "100")], {}),
        ("d", [("x-dynamo-request-strict-priority", "1")], {}),
    ], ["d", "c", "b", "a"]),
    ("vllm", {}, [("a", [], {"priority": 5}), ("b", [], {"priority": 1}),
                  ("c", [], {"priority": 3}), ("d", [("x-vllm-priority", "1")], {})],
     ["b", "d", "c", "a"]),
    ("vllm", {"vllm_scheduling_policy": "fcfs"},
     [("a", [], {"priority": 5}), ("b", [], {"priority": 1})], ["a", "b"]),
    ("sglang", {}, [("a", [], {"priority": 5}), ("b", [], {}), ("c", [], {"priority": 10}),
                    ("d", [], {"priority": 1})], ["c", "a", "d", "b"]),
    ("sglang", {"sglang_low_values_first": True},
     [("a", [], {"priority": 5}), ("b", [], {}), ("c", [], {"priority": 10}),
      ("d", [], {"priority": 1})], ["d", "a", "c", "b"]),
]  # fmt: skip


@pytest.mark.parametrize(("engine", "options", "requests", "expected"), QUEUE_CASES)
def test_queue_order_with_one_slot(
    engine: str,
    options: dict[str, Any],
    requests: list[tuple[str, H, dict[str, Any]]],
    expected: list[str],
) -> None:
    async def scenario() -> None:
        opts = {"engine": engine, "slots": 1, "tokens": 1000, "token_delay_s": 0.005, **options}
        async with engine_client(**opts) as (eng, client):
            tasks: list[asyncio.Task[httpx.Response]] = []
            blocker_headers = {"x-request-id": "blocker"}
            async with client.stream("POST", CHAT, json={"stream": True}, headers=blocker_headers):
                for rid, headers, body in requests:
                    post = client.post(CHAT, json={**body, "max_tokens": 1},
                                       headers=[("x-request-id", rid), *headers])  # fmt: skip
                    tasks.append(asyncio.create_task(post))
                    await wait_for(queued(eng, len(tasks)))
            # leaving the block disconnects the blocker, which frees the slot
            results = await asyncio.gather(*tasks)
            assert all(r.status_code == 200 for r in results)
            assert eng.snapshot()["started_order"] == ["blocker", *expected]

    run(scenario())


def _waiting(priority: int | None, arrival: float, **extra: Any) -> Waiting:
    return Waiting(Resolution(priority, "test", **extra), arrival)


KEY_CASES: list[tuple[str, dict[str, Any], dict[str, Waiting], list[str]]] = [
    ("dynamo", {}, {"late-high": _waiting(10, 5.0), "early-low": _waiting(0, 0.0)},
     ["late-high", "early-low"]),
    # 10 s of head start is not enough against a 20 s older request
    ("dynamo", {}, {"late-high": _waiting(10, 25.0), "early-low": _waiting(0, 0.0)},
     ["early-low", "late-high"]),
    ("dynamo", {}, {"negative": _waiting(-50, 0.0), "zero": _waiting(0, 0.1)},
     ["negative", "zero"]),
    ("dynamo", {}, {"soft": _waiting(1000, 0.0), "tier1": _waiting(0, 9.0, strict_priority=1)},
     ["tier1", "soft"]),
    ("dynamo", {}, {"none": _waiting(None, 0.0), "jump": _waiting(None, 1.0, jump=5.0)},
     ["jump", "none"]),
    ("vllm", {}, {"p5": _waiting(5, 0.0), "p1": _waiting(1, 1.0), "p1b": _waiting(1, 2.0)},
     ["p1", "p1b", "p5"]),
    ("vllm", {"vllm_scheduling_policy": "fcfs"}, {"p5": _waiting(None, 0.0),
                                                  "p1": _waiting(None, 1.0)}, ["p5", "p1"]),
    ("sglang", {}, {"none": _waiting(None, 0.0), "p1": _waiting(1, 1.0), "p9": _waiting(9, 2.0)},
     ["p9", "p1", "none"]),
    ("sglang", {"sglang_low_values_first": True},
     {"none": _waiting(None, 0.0), "p1": _waiting(1, 1.0), "p9": _waiting(9, 2.0)},
     ["p1", "p9", "none"]),
    ("sglang", {}, {"a": _waiting(3, 0.0), "b": _waiting(3, 1.0)}, ["a", "b"]),
    ("openai", {}, {"b": _waiting(None, 1.0), "a": _waiting(99, 2.0)}, ["b", "a"]),
]  # fmt: skip


@pytest.mark.parametrize(("engine", "options", "items", "expected"), KEY_CASES)
def test_ordering_keys(
    engine: str, options: dict[str, Any], items: dict[str, Waiting], expected: list[str]
) -> None:
    opts = MockEngineOptions(engine=engine, **options)
    order = sorted(items, key=lambda name: ORDERING[engine](items[name], opts))
    assert order == expected


@pytest.mark.parametrize(
    ("text", "bounds", "expected"),
    [
        (" 7 ", I32, 7),  # HTTP strips the whitespace anyway; Dynamo also trims
        ("\t-7", I32, -7),
        ("+7", I32, 7),
        ("7.0", I32, None),
        ("1_000", I32, None),  # Rust rejects what Python's int() would take
        ("2147483647", I32, 2**31 - 1),
        ("2147483648", I32, None),
        ("-1", U32, None),
        ("4294967295", U32, 2**32 - 1),
        ("", U32, None),
        (None, U32, None),
    ],
)
def test_parse_rust_int(text: str | None, bounds: tuple[int, int], expected: int | None) -> None:
    assert parse_rust_int(text, bounds) == expected


def test_options_reject_unknown_engine() -> None:
    with pytest.raises(ValueError):
        MockEngineOptions(engine="tgi")
