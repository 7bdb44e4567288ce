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
    ceiling=st.one_of(
        st.integers(min_value=1, max_value=2000), st.just(MAX_PRIORITY_CEILING)
    ),
    absent=st.sampled_from(AbsentPriority),
)
platform_priorities = st.integers(min_value=0, max_value=U32[1])


@st.composite
def dynamo_configs(draw: st.DrawFn) -> DynamoConfig:
    """Valid configs only: bands from most to least urgent, tiers never rising."""
    count = draw(st.integers(min_value=0, max_value=3))
    levels = sorted(
        draw(st.sets(st.integers(0, 3000), min_size=count, max_size=count))
    )
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
header_lists = st.lists(st.tuples(st.binary(min_size=1), st.binary()), max_size=6)


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
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
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
