"""Fuzzing the pipeline's pure parts for every backend adapter (hypothesis).

Whatever the input (header lists of arbitrary bytes, duplicates and casings;
bodies that are arbitrary JSON, JSON with duplicate keys, deep nesting, or not
JSON at all), the result is a clean plan or body, or one of the PylonError
subclasses the pipeline defines: never another exception. And nothing on a
deny-list survives: no deny-listed or derived header except Pylon's own
values, no hop-by-hop, tunnel-only or credential header, no deny-listed body
field except the value Pylon derived. In allowlist mode only allowed names
(and Pylon's own headers) are forwarded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from backends.base import BackendAdapter, RouteClass, dotted
from backends.config import BackendConfig
from backends.priority import PriorityPolicy
from backends.registry import BACKEND_TYPES, build_adapter
from pylon.auth import bearer_token
from pylon.errors import BadTunnelHeader, BodyInvalid, RouteNotAllowed
from pylon.pipeline import (
    CREDENTIAL_HEADERS,
    PipelineOptions,
    RequestPlan,
    header_section_size,
    plan_request,
    sanitize_body,
)
from pylon.tunnel_headers import HOP_BY_HOP_HEADERS, REQUEST_ID, TUNNEL_ONLY_HEADERS
from tunnel.types import RequestHead

CONFIGS: list[dict[str, Any]] = [
    *({"type": backend} for backend in BACKEND_TYPES),
    {"type": "sglang", "priority_scheduling": True, "low_values_first": True, "scale": 3},
    {"type": "dynamo", "strict_tier_bands": [{"max_level": 9, "tier": 2}]},
]
PLAN_ERRORS = (BadTunnelHeader, RouteNotAllowed)
"""What planning may raise for a bad request; anything else is a bug."""
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def adapter_for(config: dict[str, Any]) -> BackendAdapter:
    validated = TypeAdapter(BackendConfig).validate_python(config)
    return build_adapter(validated, PriorityPolicy())


ADAPTERS = [adapter_for(config) for config in CONFIGS]
IDS = [f"{a.name}-{i}" for i, a in enumerate(ADAPTERS)]


def interesting_names(adapter: BackendAdapter) -> list[bytes]:
    names = {*adapter.all_denied_headers(), *adapter.derived_header_names()}
    names |= {prefix + "x" for prefix in adapter.all_denied_header_prefixes()}
    raw = {name.encode() for name in names}
    raw |= HOP_BY_HOP_HEADERS | TUNNEL_ONLY_HEADERS | CREDENTIAL_HEADERS
    raw |= {b"content-type", b"accept", b"traceparent", b"x-custom", b"x-dynamo-other"}
    return sorted(raw)


def cased(name: bytes) -> st.SearchStrategy[bytes]:
    return st.sampled_from([name, name.upper(), name.title(), name.swapcase()])


def header_names(adapter: BackendAdapter) -> st.SearchStrategy[bytes]:
    known = st.sampled_from(interesting_names(adapter)).flatmap(cased)
    return st.one_of(known, st.binary(max_size=24))


HEADER_VALUES = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"7", b" 12 ", b"0", b"4294967295", b"-1", b"req-1", b"Bearer t", b""]),
)


def heads(adapter: BackendAdapter) -> st.SearchStrategy[RequestHead]:
    routes = st.sampled_from(sorted(adapter.routes))
    other = st.tuples(st.sampled_from(["GET", "POST", "PUT"]), st.text(max_size=20))
    route = st.one_of(routes, routes.map(lambda r: (r[0], r[1] + "?x=1")), other)
    fields = st.lists(st.tuples(header_names(adapter), HEADER_VALUES), max_size=16)
    return st.builds(
        lambda r, h: RequestHead(method=r[0], scheme="https", authority="", path=r[1], headers=h),
        route,
        fields.map(tuple),
    )


def options(adapter: BackendAdapter) -> st.SearchStrategy[PipelineOptions]:
    allow = st.sets(st.sampled_from(interesting_names(adapter))).map(frozenset)
    return st.builds(
        PipelineOptions,
        policy=st.builds(
            PriorityPolicy,
            ceiling=st.integers(1, 10_000),
            absent=st.sampled_from(["lowest", "omit"]),
        ),
        derive_priority=st.booleans(),
        allowed_headers=st.one_of(st.none(), allow),
    )


def assert_clean(plan: RequestPlan, adapter: BackendAdapter, opts: PipelineOptions) -> None:
    derived = set(plan.derived.headers)
    derived_names = {name.encode() for name in adapter.derived_header_names()}
    request_ids = [value for name, value in plan.headers if name == REQUEST_ID]
    expected_id = [] if plan.tunnel.request_id is None else [plan.tunnel.request_id.encode()]
    assert request_ids == expected_id
    for name, value in plan.headers:
        if (name, value) in derived or name == REQUEST_ID:
            continue
        text = name.decode("latin-1")
        assert name == name.lower()
        assert name not in derived_names, "a client value for a derived header survived"
        assert text not in adapter.all_denied_headers()
        assert not text.startswith(adapter.all_denied_header_prefixes())
        assert name not in HOP_BY_HOP_HEADERS | TUNNEL_ONLY_HEADERS | CREDENTIAL_HEADERS
        if opts.allowed_headers is not None:
            assert name in opts.allowed_headers


@pytest.mark.parametrize("adapter", ADAPTERS, ids=IDS)
def test_plan_is_clean_or_a_defined_error(adapter: BackendAdapter) -> None:
    @FUZZ
    @given(head=heads(adapter), opts=options(adapter))
    def check(head: RequestHead, opts: PipelineOptions) -> None:
        assert header_section_size(head) >= 32 * (3 + len(head.headers))
        try:
            plan = plan_request(head, adapter=adapter, options=opts)
        except PLAN_ERRORS:
            return
        assert_clean(plan, adapter, opts)

    check()


# --- bodies ---------------------------------------------------------------------------


def denied_keys(adapter: BackendAdapter) -> list[str]:
    keys = {key for path in adapter.all_denied_body_fields() for key in path}
    return sorted(keys | {"model", "messages", "stream"})


def json_values(adapter: BackendAdapter) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.text(max_size=12),
    )
    keys = st.one_of(st.sampled_from(denied_keys(adapter)), st.text(max_size=6))
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
        max_leaves=24,
    )


def with_denied_paths(adapter: BackendAdapter) -> st.SearchStrategy[dict[str, Any]]:
    """An object that has some deny-listed paths set to arbitrary values."""

    def build(base: dict[str, Any], chosen: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
        for path, value in chosen:
            target = base
            for key in path[:-1]:
                child = target.get(key)
                target[key] = child if isinstance(child, dict) else {}
                target = target[key]
            target[path[-1]] = value
        return base

    paths = st.sampled_from(list(adapter.all_denied_body_fields()) or [("priority",)])
    chosen = st.lists(st.tuples(paths, json_values(adapter)), max_size=4)
    base = st.dictionaries(st.sampled_from(denied_keys(adapter)), json_values(adapter))
    return st.builds(build, base, chosen)


def raw_bodies(adapter: BackendAdapter) -> st.SearchStrategy[bytes]:
    duplicate_keys = st.lists(
        st.tuples(st.sampled_from(denied_keys(adapter)), st.integers(-5, 5)), max_size=6
    ).map(lambda pairs: ("{" + ",".join(f'"{k}": {v}' for k, v in pairs) + "}").encode())
    return st.one_of(
        with_denied_paths(adapter).map(lambda d: json.dumps(d).encode()),
        json_values(adapter).map(lambda v: json.dumps(v).encode()),
        duplicate_keys,
        st.binary(max_size=64),
        st.sampled_from([b"[" * 3000, b'{"a":' * 1500 + b"1" + b"}" * 1500, b"NaN", b"\xff{}"]),
    )


def inference_plan(adapter: BackendAdapter, priority: bytes | None) -> RequestPlan:
    method, path = next(r for r, c in sorted(adapter.routes.items()) if c is RouteClass.INFERENCE)
    headers: tuple[tuple[bytes, bytes], ...] = ((b"x-request-id", b"fuzz"),)
    if priority is not None:
        headers += ((b"x-priority", priority),)
    head = RequestHead(method=method, scheme="https", authority="", path=path, headers=headers)
    opts = PipelineOptions(policy=PriorityPolicy(), derive_priority=True)
    return plan_request(head, adapter=adapter, options=opts)


def lookup(document: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(document, dict) or key not in document:
            return False, None
        document = document[key]
    return True, document


@pytest.mark.parametrize("adapter", ADAPTERS, ids=IDS)
def test_body_is_clean_or_rejected(adapter: BackendAdapter) -> None:
    @FUZZ
    @given(raw=raw_bodies(adapter), priority=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
    def check(raw: bytes, priority: int | None) -> None:
        plan = inference_plan(adapter, None if priority is None else str(priority).encode())
        try:
            body, stripped = sanitize_body(adapter, plan, raw)
        except BodyInvalid:
            return
        document = json.loads(body)
        assert isinstance(document, dict)
        assert set(stripped) <= {dotted(path) for path in adapter.all_denied_body_fields()}
        for path in adapter.all_denied_body_fields():
            present, value = lookup(document, path)
            if path in plan.derived.body_fields:
                assert (present, value) == (True, plan.derived.body_fields[path])
            else:
                assert not present, f"{dotted(path)} survived"
        again, _ = sanitize_body(adapter, plan, body)
        assert json.loads(again) == document, "sanitizing twice changed the body"

    check()


@FUZZ
@given(st.lists(st.tuples(st.binary(max_size=16), st.binary(max_size=40)), max_size=6))
def test_bearer_token_never_raises(headers: list[tuple[bytes, bytes]]) -> None:
    token = bearer_token(headers)
    assert token is None or (token and token == token.strip())
