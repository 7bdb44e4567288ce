"""The pure pipeline: one plan per request head, for every backend."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.base import RouteClass
from backends.config import DynamoConfig, PassthroughConfig, SglangConfig, VllmConfig
from backends.priority import AbsentPriority, PriorityPolicy
from backends.registry import build_adapter
from pylon.errors import BadTunnelHeader, PylonError, RouteNotAllowed
from pylon.pipeline import Derivation, PipelineOptions, header_section_size, plan_request
from tunnel.types import RequestHead

POLICY = PriorityPolicy()
CONFIGS = {
    "passthrough": PassthroughConfig(),
    "dynamo": DynamoConfig(),
    "vllm": VllmConfig(),
    "sglang": SglangConfig(priority_scheduling=True),
}


def head(path: str = "/v1/chat/completions", method: str = "POST", **headers: str) -> RequestHead:
    fields = tuple((k.replace("_", "-").encode(), v.encode()) for k, v in headers.items())
    return RequestHead(method=method, scheme="https", authority="n", path=path, headers=fields)


def options(
    *, derive: bool = True, absent: AbsentPriority = AbsentPriority.LOWEST
) -> PipelineOptions:
    return PipelineOptions(policy=PriorityPolicy(absent=absent), derive_priority=derive)


@pytest.mark.parametrize(
    ("backend", "request_head", "opts", "outcome"),
    [
        ("dynamo", head(x_request_id="r", x_priority="5"), options(), Derivation.EMITTED),
        ("dynamo", head(x_request_id="r"), options(), Derivation.ABSENT_NORMALIZED),
        (
            "dynamo",
            head(x_request_id="r"),
            options(absent=AbsentPriority.OMIT),
            Derivation.ABSENT_OMITTED,
        ),
        (
            "vllm",
            head(x_request_id="r"),
            options(absent=AbsentPriority.OMIT),
            Derivation.ABSENT_NORMALIZED,
        ),
        (
            "sglang",
            head(x_request_id="r", x_priority="5"),
            options(derive=False),
            Derivation.DISABLED,
        ),
        (
            "passthrough",
            head(x_request_id="r", x_priority="5"),
            options(),
            Derivation.NOT_APPLICABLE,
        ),
        (
            "vllm",
            head("/v1/models", "GET", x_request_id="r", x_priority="1"),
            options(),
            Derivation.NOT_APPLICABLE,
        ),
        ("vllm", head("/health", "GET"), options(), Derivation.NOT_APPLICABLE),
    ],
)
def test_derivation_outcomes(
    backend: str, request_head: RequestHead, opts: PipelineOptions, outcome: Derivation
) -> None:
    plan = plan_request(request_head, adapter=build_adapter(CONFIGS[backend], POLICY), options=opts)
    assert plan.derivation is outcome


def test_vllm_never_leaves_priority_to_the_engine_default() -> None:
    """vLLM reads a missing priority as 0, its most urgent class: absent must still be sent."""
    adapter = build_adapter(CONFIGS["vllm"], POLICY)
    plan = plan_request(
        head(x_request_id="r"), adapter=adapter, options=options(absent=AbsentPriority.OMIT)
    )
    assert plan.derived.emitted_priority == POLICY.ceiling


def test_plan_forwards_one_request_id_and_drops_tunnel_and_hop_headers() -> None:
    request = head(
        x_request_id="r-9",
        x_priority="2",
        x_stargate_expected_queue_ms="40",
        connection="x-drop",
        x_drop="1",
        accept="*/*",
    )
    plan = plan_request(
        request, adapter=build_adapter(CONFIGS["dynamo"], POLICY), options=options()
    )
    names = [name for name, _ in plan.headers]
    assert names.count(b"x-request-id") == 1
    assert (b"x-request-id", b"r-9") in plan.headers
    for dropped in (b"x-priority", b"x-stargate-expected-queue-ms", b"connection", b"x-drop"):
        assert dropped not in names
    assert (b"accept", b"*/*") in plan.headers
    assert (b"x-dynamo-request-priority", b"998") in plan.headers


def test_route_and_header_errors() -> None:
    adapter = build_adapter(CONFIGS["sglang"], POLICY)
    with pytest.raises(RouteNotAllowed):
        plan_request(head("/flush_cache", x_request_id="r"), adapter=adapter, options=options())
    with pytest.raises(BadTunnelHeader):
        plan_request(head(), adapter=adapter, options=options())
    plan = plan_request(head("/health", "GET"), adapter=adapter, options=options())
    assert plan.route_class is RouteClass.HEALTH
    assert plan.tunnel.request_id is None


@given(
    st.sampled_from(sorted(CONFIGS)),
    st.lists(st.tuples(st.binary(max_size=24), st.binary(max_size=24)), max_size=12),
)
def test_any_header_list_plans_or_raises_a_pylon_error(backend: str, headers: list) -> None:
    adapter = build_adapter(CONFIGS[backend], POLICY)
    request = RequestHead("POST", "https", "n", "/v1/chat/completions", tuple(headers))
    try:
        plan = plan_request(request, adapter=adapter, options=options())
    except PylonError:
        return
    names = [name for name, _ in plan.headers]
    assert names.count(b"x-request-id") == 1
    denied = {n.encode() for n in adapter.all_denied_headers()}
    assert not denied & set(names) - {n.encode() for n in adapter.derived_header_names()}


@pytest.mark.parametrize(("authority", "expected"), [("a", 207), ("", 164)])
def test_header_section_size_counts_each_field_as_rfc9114_does(
    authority: str, expected: int
) -> None:
    # name + value + 32 per field: :method POST 43, :scheme https 44, :path /v1 40,
    # :authority a 43 (only when present), x-a: bc 37.
    head = RequestHead("POST", "https", authority, "/v1", ((b"x-a", b"bc"),))
    assert header_section_size(head) == expected
