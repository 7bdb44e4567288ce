"""Backend adapters and the sanitizing functions their tables feed.

Priority properties are checked through a small model of each engine's own
parser (header beats body only when well-formed, first value wins, polarity),
applied to exactly what Pylon would forward, so "monotonic" means "the ENGINE
ranks it at least as urgent", not "the number went the right way".
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from backends import (
    BACKEND_TYPES,
    AbsentPriority,
    BackendAdapter,
    BackendConfig,
    BodyRejected,
    Derived,
    DynamoAdapter,
    DynamoConfig,
    DynamoStrictBand,
    PassthroughAdapter,
    PassthroughConfig,
    PriorityPolicy,
    RouteClass,
    SglangAdapter,
    SglangConfig,
    VllmAdapter,
    VllmConfig,
    build_adapter,
    normalize_level,
    rewrite_json_body,
    strip_headers,
)
from backends.base import BodyPath, Headers, dotted, prefix_pattern
from backends.config import MAX_SGLANG_SCALE
from backends.priority import MAX_PRIORITY_CEILING

I32 = (-(2**31), 2**31 - 1)
U32 = (0, 2**32 - 1)
ADAPTER_CLASSES: tuple[type[BackendAdapter], ...] = (
    PassthroughAdapter,
    DynamoAdapter,
    VllmAdapter,
    SglangAdapter,
)
DEFAULT_ADAPTERS = [
    PassthroughAdapter(),
    DynamoAdapter(),
    VllmAdapter(),
    SglangAdapter(SglangConfig(priority_scheduling=True)),
]
ids = [adapter.name for adapter in DEFAULT_ADAPTERS]
MISSING = object()

# No deadline: these are pure functions, and a loaded CI box must not flake.
pure = settings(deadline=None)
pure_slow = settings(pure, max_examples=60)
"""For properties that build and parse whole JSON bodies."""

# --- engine models: how each engine resolves what Pylon forwarded -----------


def first_header(headers: Headers, name: bytes) -> bytes | None:
    return next((value for key, value in headers if key.lower() == name), None)


def body_get(body: Any, path: BodyPath) -> Any:
    node = body
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return MISSING
        node = node[key]
    return node


def rust_int(raw: bytes | None, bounds: tuple[int, int]) -> int | None:
    """Rust `s.trim().parse::<iN/uN>()`: optional sign, ASCII digits, in range."""
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        return None
    value = int(text)
    return value if bounds[0] <= value <= bounds[1] else None


def json_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def py_int(raw: bytes | None) -> int | None:
    try:
        return None if raw is None else int(raw.decode("latin-1"))
    except ValueError:
        return None


def dynamo_rank(adapter: BackendAdapter, headers: Headers, body: Any) -> tuple[float, ...]:
    """(strict tier, queue jump): header when well-formed, else body; higher wins."""
    hints = body_get(body, ("nvext", "agent_hints"))
    hints = hints if isinstance(hints, dict) else {}
    priority = rust_int(first_header(headers, b"x-dynamo-request-priority"), I32)
    if priority is None:
        priority = json_int(hints.get("priority"))
    strict = rust_int(first_header(headers, b"x-dynamo-request-strict-priority"), U32)
    if strict is None:
        strict = json_int(hints.get("strict_priority"))
    jump = priority if priority is not None else hints.get("latency_sensitivity", 0)
    return (strict or 0, max(float(jump), 0.0))


def vllm_rank(adapter: BackendAdapter, headers: Headers, body: Any) -> tuple[float, ...]:
    """A well-formed X-Vllm-Priority beats the body; absent is 0; lower first."""
    priority = py_int(first_header(headers, b"x-vllm-priority"))
    if priority is None:
        priority = json_int(body.get("priority")) or 0
    return (-priority,)


def sglang_rank(adapter: BackendAdapter, headers: Headers, body: Any) -> tuple[float, ...]:
    """x-override-priority (overrides enabled) beats the body; absent runs last."""
    assert isinstance(adapter, SglangAdapter)
    priority = py_int(first_header(headers, b"x-override-priority"))
    if priority is None:
        priority = json_int(body.get("priority"))
    if priority is None or not adapter.config.priority_scheduling:
        return (0, 0)
    return (1, -priority if adapter.config.low_values_first else priority)


def passthrough_rank(adapter: BackendAdapter, headers: Headers, body: Any) -> tuple[float, ...]:
    return (0,)


ENGINE_RANK: Mapping[str, Callable[[BackendAdapter, Headers, Any], tuple[float, ...]]] = {
    "passthrough": passthrough_rank,
    "dynamo": dynamo_rank,
    "vllm": vllm_rank,
    "sglang": sglang_rank,
}

SPOOF_HEADERS: Headers = [
    (b"X-Dynamo-Request-Priority", b"2147483647"),
    (b"x-dynamo-request-strict-priority", b"4294967295"),
    (b"X-VLLM-PRIORITY", b"-1000000"),
    (b"x-override-priority", b"999999999"),
    (b"X-Dynamo-Meta-Policy-Class", b"premium"),
]
SPOOF_BODY: dict[str, Any] = {
    "priority": -(10**6),
    "nvext": {
        "agent_hints": {
            "priority": 2**31 - 1,
            "strict_priority": 2**32 - 1,
            "latency_sensitivity": 1e9,
        }
    },
}


def forward(
    adapter: BackendAdapter, priority: int | None, *, headers: Headers, body: bytes
) -> tuple[Headers, Any]:
    """What Pylon would send the engine: strip, derive, rewrite."""
    derived = adapter.derive(normalize_level(priority, adapter.policy))
    sanitized = strip_headers(adapter, headers)
    rewritten = rewrite_json_body(adapter, body, derived).body
    return sanitized.headers + list(derived.headers), json.loads(rewritten)


def engine_rank(adapter: BackendAdapter, priority: int | None, *, spoof: bool) -> tuple[float, ...]:
    headers = list(SPOOF_HEADERS) if spoof else []
    body = json.dumps(SPOOF_BODY if spoof else {}).encode()
    out_headers, out_body = forward(adapter, priority, headers=headers, body=body)
    return ENGINE_RANK[adapter.name](adapter, out_headers, out_body)


# --- strategies ------------------------------------------------------------

policies = st.builds(
    PriorityPolicy,
    ceiling=st.one_of(st.integers(min_value=1, max_value=2000), st.just(MAX_PRIORITY_CEILING)),
    absent=st.sampled_from(AbsentPriority),
)
platform_priorities = st.integers(min_value=0, max_value=U32[1])


@st.composite
def dynamo_configs(draw: st.DrawFn) -> DynamoConfig:
    """Valid configs only: bands from most to least urgent, tiers never rising."""
    count = draw(st.integers(min_value=0, max_value=3))
    levels = sorted(draw(st.sets(st.integers(0, 3000), min_size=count, max_size=count)))
    tiers = sorted(draw(st.lists(st.integers(*U32), min_size=count + 1, max_size=count + 1)))
    tiers.reverse()
    bands = tuple(
        DynamoStrictBand(max_level=level, tier=tier)
        for level, tier in zip(levels, tiers, strict=False)
    )
    return DynamoConfig(strict_priority=tiers[-1], strict_tier_bands=bands)


sglang_configs = st.builds(
    SglangConfig,
    priority_scheduling=st.booleans(),
    low_values_first=st.booleans(),
    scale=st.one_of(st.integers(1, 1000), st.just(MAX_SGLANG_SCALE)),
)


@st.composite
def adapters(draw: st.DrawFn) -> BackendAdapter:
    policy = draw(policies)
    config: BackendConfig = draw(
        st.one_of(
            st.just(PassthroughConfig()),
            dynamo_configs(),
            st.just(VllmConfig()),
            sglang_configs,
        )
    )
    return build_adapter(config, policy)


def cased(name: str) -> st.SearchStrategy[bytes]:
    """Any ASCII casing of `name`."""
    flips = st.lists(st.booleans(), min_size=len(name), max_size=len(name))
    return flips.map(
        lambda fs: "".join(c.upper() if f else c for c, f in zip(name, fs, strict=True)).encode()
    )


def exact_denied(adapter: BackendAdapter) -> list[str]:
    return sorted(adapter.all_denied_headers() | adapter.derived_header_names())


def denied_names(adapter: BackendAdapter) -> st.SearchStrategy[bytes]:
    suffixes = st.text(alphabet=string.ascii_lowercase + string.digits + "-", max_size=8)
    exact = st.sampled_from(exact_denied(adapter)).flatmap(cased)
    family = st.tuples(st.sampled_from(adapter.all_denied_header_prefixes()), suffixes).flatmap(
        lambda ps: cased(ps[0] + ps[1])
    )
    return st.one_of(exact, family)


token_names = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1).map(
    str.encode
)


def mixed_headers(adapter: BackendAdapter) -> st.SearchStrategy[Headers]:
    names = st.one_of(denied_names(adapter), token_names, st.binary(min_size=1, max_size=24))
    return st.lists(st.tuples(names, st.binary(max_size=12)), max_size=12)


def is_denied(adapter: BackendAdapter, name: bytes) -> bool:
    lowered = name.lower().decode("latin-1")
    exact = adapter.all_denied_headers() | adapter.derived_header_names()
    return lowered in exact or lowered.startswith(adapter.all_denied_header_prefixes())


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


def put(document: dict[str, Any], path: BodyPath, value: Any) -> None:
    node = document
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@st.composite
def bodies_with_denied(draw: st.DrawFn, adapter: BackendAdapter) -> bytes:
    """A JSON object with some deny-listed paths planted at random."""
    document = draw(json_objects)
    fields = adapter.all_denied_body_fields()
    planted = draw(st.lists(st.sampled_from(fields), unique=True)) if fields else []
    for path in planted:
        put(document, path, draw(json_values))
    return json.dumps(document).encode()


# --- priority: monotonic, bounded, well-formed, absent never promoted --------


@pure
@given(adapter=adapters(), a=platform_priorities, b=platform_priorities)
def test_engine_ranks_more_urgent_priority_at_least_as_urgent(
    adapter: BackendAdapter, a: int, b: int
) -> None:
    urgent, relaxed = sorted((a, b))
    assert engine_rank(adapter, urgent, spoof=True) >= engine_rank(adapter, relaxed, spoof=True)


@pure
@given(adapter=adapters(), p=st.one_of(st.none(), platform_priorities))
def test_client_inputs_never_change_the_engine_rank(adapter: BackendAdapter, p: int | None) -> None:
    assert engine_rank(adapter, p, spoof=True) == engine_rank(adapter, p, spoof=False)


@pure
@given(adapter=adapters(), p=platform_priorities)
def test_absent_is_never_more_urgent_than_any_priority(adapter: BackendAdapter, p: int) -> None:
    absent = engine_rank(adapter, None, spoof=True)
    assert absent <= engine_rank(adapter, p, spoof=True)
    if adapter.derive(0) != Derived():  # the engine sees a priority at all
        assert absent < engine_rank(adapter, 0, spoof=True)


@pure
@given(adapter=adapters(), p=st.one_of(st.none(), platform_priorities))
def test_derive_writes_only_its_declared_names(adapter: BackendAdapter, p: int | None) -> None:
    derived = adapter.derive(normalize_level(p, adapter.policy))
    names = [name.decode() for name, _ in derived.headers]
    assert len(names) == len(set(names))
    assert set(names) <= adapter.derived_header_names()
    assert set(derived.body_fields) <= set(adapter.derived_body_fields)


@pure
@given(config=dynamo_configs(), policy=policies, p=st.one_of(st.none(), platform_priorities))
def test_dynamo_headers_are_well_formed_and_in_range(
    config: DynamoConfig, policy: PriorityPolicy, p: int | None
) -> None:
    adapter = DynamoAdapter(config, policy)
    headers, _ = forward(adapter, p, headers=list(SPOOF_HEADERS), body=b"{}")
    priority = [v for k, v in headers if k == b"x-dynamo-request-priority"]
    strict = [v for k, v in headers if k == b"x-dynamo-request-strict-priority"]
    if normalize_level(p, policy) is None:
        assert priority == strict == []
        return
    assert len(priority) == len(strict) == 1  # set once, never appended
    assert re.fullmatch(rb"[0-9]+", priority[0])
    assert re.fullmatch(rb"[0-9]+", strict[0])
    soft, tier = rust_int(priority[0], I32), rust_int(strict[0], U32)
    assert soft is not None
    assert tier is not None
    assert 0 <= soft <= policy.ceiling


@pure
@given(policy=policies, p=st.one_of(st.none(), platform_priorities))
def test_vllm_priority_is_an_int_in_range_even_when_absent(
    policy: PriorityPolicy, p: int | None
) -> None:
    _, body = forward(VllmAdapter(policy=policy), p, headers=[], body=b'{"priority": -5}')
    priority = json_int(body["priority"])
    assert priority is not None
    assert 0 <= priority <= policy.ceiling
    if p is None:
        assert priority == policy.ceiling


@pure
@given(config=sglang_configs, policy=policies, p=st.one_of(st.none(), platform_priorities))
def test_sglang_priority_only_when_enabled_and_in_range(
    config: SglangConfig, policy: PriorityPolicy, p: int | None
) -> None:
    adapter = SglangAdapter(config, policy)
    _, body = forward(adapter, p, headers=[], body=b'{"priority": 7}')
    if not config.priority_scheduling or normalize_level(p, policy) is None:
        assert "priority" not in body
        return
    priority = json_int(body["priority"])
    assert priority is not None
    assert 0 <= priority <= policy.ceiling * config.scale


@pytest.mark.parametrize(
    ("config", "level", "priority", "tier"),
    [
        (DynamoConfig(), 0, b"1000", b"0"),
        (DynamoConfig(), 1000, b"0", b"0"),
        (DynamoConfig(strict_priority=3), 250, b"750", b"3"),
        (
            DynamoConfig(strict_tier_bands=(DynamoStrictBand(max_level=10, tier=2),)),
            10,
            b"990",
            b"2",
        ),
        (
            DynamoConfig(strict_tier_bands=(DynamoStrictBand(max_level=10, tier=2),)),
            11,
            b"989",
            b"0",
        ),
    ],
)
def test_dynamo_mapping_table(
    config: DynamoConfig, level: int, priority: bytes, tier: bytes
) -> None:
    derived = DynamoAdapter(config, PriorityPolicy()).derive(level)
    assert derived.headers == (
        (b"x-dynamo-request-priority", priority),
        (b"x-dynamo-request-strict-priority", tier),
    )
    assert derived.emitted_priority == int(priority)


@pytest.mark.parametrize(
    ("config", "level", "expected"),
    [
        (SglangConfig(), 3, None),
        (SglangConfig(priority_scheduling=True), 3, 997),
        (SglangConfig(priority_scheduling=True, scale=20), 3, 19940),
        (SglangConfig(priority_scheduling=True, low_values_first=True), 3, 3),
        (SglangConfig(priority_scheduling=True, low_values_first=True, scale=20), 3, 60),
        (SglangConfig(priority_scheduling=True), None, None),
    ],
)
def test_sglang_mapping_table(
    config: SglangConfig, level: int | None, expected: int | None
) -> None:
    derived = SglangAdapter(config, PriorityPolicy()).derive(level)
    assert derived.body_fields.get(("priority",)) == expected
    assert derived.emitted_priority == expected


@pytest.mark.parametrize(("level", "expected"), [(0, 0), (5, 5), (1000, 1000), (None, 1000)])
def test_vllm_mapping_table(level: int | None, expected: int) -> None:
    assert VllmAdapter().derive(level).body_fields == {("priority",): expected}


def test_passthrough_derives_nothing() -> None:
    assert PassthroughAdapter().derive(0) == Derived()


@pytest.mark.parametrize(
    "bands",
    [
        ((10, 1), (10, 0)),  # max_level not strictly increasing
        ((20, 1), (10, 2)),
        ((10, 1), (20, 2)),  # a less urgent band in a higher tier
    ],
)
def test_dynamo_config_rejects_bands_that_invert_urgency(
    bands: tuple[tuple[int, int], ...],
) -> None:
    with pytest.raises(ValidationError):
        DynamoConfig(
            strict_tier_bands=tuple(DynamoStrictBand(max_level=m, tier=t) for m, t in bands)
        )


def test_dynamo_config_rejects_fallback_above_the_last_band() -> None:
    with pytest.raises(ValidationError):
        DynamoConfig(strict_priority=2, strict_tier_bands=(DynamoStrictBand(max_level=5, tier=1),))


# --- header stripping ------------------------------------------------------


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
def test_deny_tables_are_lowercase(adapter: BackendAdapter) -> None:
    """Matching lowercases the request's names: an uppercase entry would never match."""
    entries = [*exact_denied(adapter), *adapter.all_denied_header_prefixes()]
    assert all(entry == entry.lower() and entry.isascii() for entry in entries)


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pure
@given(data=st.data())
def test_any_casing_of_a_denied_name_is_removed(
    adapter: BackendAdapter, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(exact_denied(adapter)))
    result = strip_headers(adapter, [(data.draw(cased(name)), b"1"), (b"Accept", b"*/*")])
    assert result.headers == [(b"accept", b"*/*")]
    assert result.stripped == (name,)


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pure
@given(data=st.data())
def test_any_casing_of_a_denied_family_is_removed(
    adapter: BackendAdapter, data: st.DataObject
) -> None:
    prefix = data.draw(st.sampled_from(adapter.all_denied_header_prefixes()))
    suffix = data.draw(st.text(alphabet=string.ascii_lowercase + "-", max_size=10))
    exact = adapter.all_denied_headers() | adapter.derived_header_names()
    result = strip_headers(adapter, [(data.draw(cased(prefix + suffix)), b"1")])
    assert result.headers == []
    label = prefix + suffix if prefix + suffix in exact else prefix_pattern(prefix)
    assert result.stripped == (label,)


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pure
@given(data=st.data())
def test_no_denied_header_survives(adapter: BackendAdapter, data: st.DataObject) -> None:
    headers = data.draw(mixed_headers(adapter))
    result = strip_headers(adapter, headers)
    assert not any(is_denied(adapter, name) for name, _ in result.headers)
    assert all(name == name.lower() for name, _ in result.headers)
    labels = set(exact_denied(adapter)) | {
        prefix_pattern(p) for p in adapter.all_denied_header_prefixes()
    }
    assert set(result.stripped) <= labels
    assert list(result.stripped) == sorted(set(result.stripped))
    assert len(result.headers) == sum(not is_denied(adapter, n) for n, _ in headers)


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pure
@given(data=st.data())
def test_strip_is_idempotent(adapter: BackendAdapter, data: st.DataObject) -> None:
    once = strip_headers(adapter, data.draw(mixed_headers(adapter)))
    twice = strip_headers(adapter, once.headers)
    assert twice.headers == once.headers
    assert twice.stripped == ()


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pure
@given(headers=st.lists(st.tuples(token_names, st.binary(max_size=12)), max_size=8))
def test_allowed_headers_pass_unchanged_in_order(adapter: BackendAdapter, headers: Headers) -> None:
    allowed = [(name, value) for name, value in headers if not is_denied(adapter, name)]
    result = strip_headers(adapter, allowed)
    assert result.headers == [(name.lower(), value) for name, value in allowed]
    assert result.stripped == ()


@pytest.mark.parametrize(
    ("name", "stripped"),
    [
        # stripped: derived, routing, identity, session, and the meta family
        ("x-dynamo-request-priority", True),
        ("x-dynamo-request-strict-priority", True),
        ("x-dynamo-worker-instance-id", True),
        ("x-dynamo-prefill-instance-id", True),
        ("x-dynamo-dp-rank", True),
        ("x-dynamo-prefill-dp-rank", True),
        ("x-dynamo-request-id", True),
        ("x-dynamo-session-id", True),
        ("x-dynamo-parent-session-id", True),
        ("x-dynamo-session-final", True),
        ("x-dynamo-meta-policy-class", True),
        ("x-dynamo-meta-anything", True),
        ("x-dynamo-meta-", True),
        # forwarded on purpose: Dynamo reads none of these
        ("x-dynamo-nvext", False),
        ("x-dynamo-something-new", False),
        ("x-dynamo-request-trace", False),
        ("x-dynamo-request-", False),
        ("x-dynamo-meta", False),
        ("x-dynamo-metadata", False),
        ("x-dynamo-worker-instance-ids", False),
        ("x-dynamo", False),
    ],
)
def test_dynamo_pins_which_x_dynamo_headers_are_forwarded(name: str, stripped: bool) -> None:
    result = strip_headers(DynamoAdapter(), [(name.upper().encode(), b"1")])
    assert (result.headers == []) is stripped


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pytest.mark.parametrize(
    "name",
    [
        "x-data-parallel-rank",
        "x-prefiller-host-port",
        "x-encoder-hosts-ports",
        "x-data-parallel-host-port",
        "x-kv-cache-source-host-port",
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-served",
    ],
)
def test_every_backend_strips_trusted_router_headers(adapter: BackendAdapter, name: str) -> None:
    assert strip_headers(adapter, [(name.encode(), b"10.0.0.1:8000")]).headers == []


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
def test_ordinary_headers_pass_through_the_adapter(adapter: BackendAdapter) -> None:
    """x-request-id is the pipeline's (one copy, the tunnel's); the adapter leaves it."""
    headers = [(b"x-request-id", b"abc"), (b"content-type", b"json"), (b"accept", b"*/*")]
    assert strip_headers(adapter, headers).headers == headers


# --- body rewriting --------------------------------------------------------


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@given(data=st.data())
@pure_slow
def test_no_denied_body_field_survives(adapter: BackendAdapter, data: st.DataObject) -> None:
    raw = data.draw(bodies_with_denied(adapter))
    derived = adapter.derive(data.draw(st.one_of(st.none(), st.integers(0, 1000))))
    body = json.loads(rewrite_json_body(adapter, raw, derived).body)
    for path in adapter.all_denied_body_fields():
        assert body_get(body, path) is MISSING or derived.body_fields.get(path) == body_get(
            body, path
        )
    for path, value in derived.body_fields.items():
        assert body_get(body, path) == value


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@given(data=st.data())
@pure_slow
def test_sanitizing_twice_equals_once(adapter: BackendAdapter, data: st.DataObject) -> None:
    raw = data.draw(bodies_with_denied(adapter))
    derived = adapter.derive(data.draw(st.one_of(st.none(), st.integers(0, 1000))))
    once = rewrite_json_body(adapter, raw, derived)
    twice = rewrite_json_body(adapter, once.body, derived)
    # Equal as JSON: which codec serializes (orjson, or the stdlib for wide
    # numbers) may differ between passes, and with it the escaping of text.
    assert json.loads(twice.body) == json.loads(once.body)
    assert set(twice.stripped) <= {dotted(p) for p in adapter.derived_body_fields}


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@given(document=json_objects)
@pure_slow
def test_clean_body_round_trips(adapter: BackendAdapter, document: dict[str, Any]) -> None:
    for path in adapter.all_denied_body_fields():
        document.pop(path[0], None)
    result = rewrite_json_body(adapter, json.dumps(document).encode(), Derived())
    assert json.loads(result.body) == document
    assert result.stripped == ()


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pure
@given(raw=st.one_of(st.binary(max_size=40), json_values.map(lambda v: json.dumps(v).encode())))
def test_any_bytes_give_an_object_or_body_rejected(adapter: BackendAdapter, raw: bytes) -> None:
    try:
        result = rewrite_json_body(adapter, raw, adapter.derive(1))
    except BodyRejected as exc:
        assert exc.reason in {"invalid_json", "not_object"}
        return
    assert isinstance(json.loads(result.body), dict)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "invalid_json"),
        (b"   ", "invalid_json"),
        (b"{", "invalid_json"),
        (b"{'priority': 1}", "invalid_json"),
        (b'{"a":1}{}', "invalid_json"),
        (b"\xff\xfe\x00", "invalid_json"),
        (b"[" * 5000 + b"]" * 5000, "invalid_json"),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, "invalid_json"),
        (b"[]", "not_object"),
        (b"null", "not_object"),
        (b'"text"', "not_object"),
        (b"1", "not_object"),
        (b"123456789012345678901234567890", "not_object"),
        (b"[NaN]", "not_object"),
    ],
)
def test_rejected_bodies(raw: bytes, reason: str) -> None:
    with pytest.raises(BodyRejected) as caught:
        rewrite_json_body(VllmAdapter(), raw, VllmAdapter().derive(1))
    assert caught.value.reason == reason


@pytest.mark.parametrize(
    "raw",
    [
        b'{"seed": 123456789012345678901234567890, "priority": 1}',
        b'{"seed": -9223372036854775809, "text": "0123456789012345678901"}',
        b'{"seed": 18446744073709551616}',
        b'{"temperature": NaN, "priority": 3}',
        b'{"text": "\\ud800 lone surrogate"}',
        '{"text": "ünïcode"}'.encode("utf-16"),
    ],
)
def test_what_only_the_stdlib_reads_is_kept_exact(raw: bytes) -> None:
    result = rewrite_json_body(VllmAdapter(), raw, VllmAdapter().derive(2))
    expected = json.loads(raw)
    expected["priority"] = 2
    assert json.loads(result.body) == expected or "NaN" in result.body.decode()
    if b"NaN" in raw:
        assert b"NaN" in result.body


@pytest.mark.parametrize(
    "document",
    [
        {"nvext": 5},
        {"nvext": [{"dp_rank": 1}]},
        {"nvext": {"agent_hints": "high"}},
        {"nvext": {"agent_hints": None}},
    ],
)
def test_non_object_inside_a_denied_path_is_left_alone(document: dict[str, Any]) -> None:
    result = rewrite_json_body(DynamoAdapter(), json.dumps(document).encode(), Derived())
    assert json.loads(result.body) == document
    assert result.stripped == ()


class _NestedWriter(BackendAdapter):
    """A test adapter that writes a nested derived field."""

    name = "nested"
    derived_body_fields = (("a", "b", "c"),)

    def derive(self, level: int | None) -> Derived:
        return Derived(body_fields={("a", "b", "c"): level})


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({}, {"a": {"b": {"c": 4}}}),
        ({"a": 3}, {"a": {"b": {"c": 4}}}),
        ({"a": {"x": 1, "b": {"c": 9, "d": 2}}}, {"a": {"x": 1, "b": {"c": 4, "d": 2}}}),
        ({"a": {"b": [1]}}, {"a": {"b": {"c": 4}}}),
    ],
)
def test_derived_fields_create_their_objects(
    document: dict[str, Any], expected: dict[str, Any]
) -> None:
    adapter = _NestedWriter()
    derived = adapter.derive(4)
    result = rewrite_json_body(adapter, json.dumps(document).encode(), derived)
    assert json.loads(result.body) == expected
    assert derived.body_fields == {("a", "b", "c"): 4}  # the caller's value is untouched


def test_stripped_body_fields_follow_the_deny_list_order() -> None:
    raw = json.dumps(
        {"cache_salt": "s", "nvext": {"agent_hints": {"priority": 1}, "dp_rank": 0}}
    ).encode()
    result = rewrite_json_body(DynamoAdapter(), raw, Derived())
    assert result.stripped == ("nvext.dp_rank", "nvext.agent_hints.priority", "cache_salt")
    assert json.loads(result.body) == {"nvext": {"agent_hints": {}}}


# --- routes ----------------------------------------------------------------

ADMIN_ROUTES = [
    ("GET", "/metrics"),
    ("POST", "/metrics"),
    ("POST", "/flush_cache"),
    ("GET", "/flush_cache"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/busy_threshold"),
    ("GET", "/busy_threshold"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("POST", "/abort_request"),
    ("POST", "/start_profile"),
    ("GET", "/server_info"),
    ("GET", "/load"),
    ("GET", "/version"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/open_session"),
]


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_are_not_reachable(adapter: BackendAdapter, method: str, path: str) -> None:
    assert adapter.route_class(method, path) is None


@pytest.mark.parametrize(
    ("adapter", "method", "path", "expected"),
    [
        (DynamoAdapter(), "POST", "/v1/chat/completions", RouteClass.INFERENCE),
        (DynamoAdapter(), "post", "/v1/responses?stream=true", RouteClass.INFERENCE),
        (DynamoAdapter(), "GET", "/v1/chat/completions", None),
        (DynamoAdapter(), "GET", "/live", RouteClass.HEALTH),
        (DynamoAdapter(), "POST", "/generate", None),
        (DynamoAdapter(), "GET", "/v1/models/", None),
        (DynamoAdapter(), "POST", "//v1/chat/completions", None),
        (DynamoAdapter(), "POST", "/v1/chat%2Fcompletions", None),
        (VllmAdapter(), "GET", "/ping", RouteClass.HEALTH),
        (VllmAdapter(), "GET", "/v1/models", RouteClass.MODELS),
        (VllmAdapter(), "POST", "/v1/embeddings", RouteClass.INFERENCE),
        (VllmAdapter(), "GET", "/live", None),
        (SglangAdapter(), "POST", "/generate", RouteClass.INFERENCE),
        (SglangAdapter(), "GET", "/health_generate", RouteClass.HEALTH),
        (SglangAdapter(), "GET", "/ready", RouteClass.HEALTH),
        (SglangAdapter(), "POST", "/v1/responses", None),
        (PassthroughAdapter(), "POST", "/v1/responses", RouteClass.INFERENCE),
        (PassthroughAdapter(), "GET", "/ping", None),
        (PassthroughAdapter(), "POST", "/generate", None),
    ],
)
def test_route_table(
    adapter: BackendAdapter, method: str, path: str, expected: RouteClass | None
) -> None:
    assert adapter.route_class(method, path) is expected


@pytest.mark.parametrize("adapter", DEFAULT_ADAPTERS, ids=ids)
def test_only_inference_bodies_are_rewritten(adapter: BackendAdapter) -> None:
    engine = not isinstance(adapter, PassthroughAdapter)
    assert adapter.rewrites_body(RouteClass.INFERENCE) is engine
    assert adapter.rewrites_body(RouteClass.MODELS) is False
    assert adapter.rewrites_body(RouteClass.HEALTH) is False


# --- registry --------------------------------------------------------------


def test_backend_types_match_the_config_union() -> None:
    union = get_args(get_args(BackendConfig)[0])
    config_types = {cls.model_fields["type"].default for cls in union}
    assert set(BACKEND_TYPES) == config_types
    assert {cls.name for cls in ADAPTER_CLASSES} == config_types


@pytest.mark.parametrize(
    ("config", "cls"),
    [
        (PassthroughConfig(), PassthroughAdapter),
        (DynamoConfig(strict_priority=4), DynamoAdapter),
        (VllmConfig(), VllmAdapter),
        (SglangConfig(scale=3), SglangAdapter),
    ],
)
def test_build_adapter_by_type(config: BackendConfig, cls: type[BackendAdapter]) -> None:
    policy = PriorityPolicy(ceiling=77)
    adapter = build_adapter(config, policy)
    assert type(adapter) is cls
    assert adapter.name == config.type
    assert adapter.policy is policy
    assert vars(adapter)["config"] is config
