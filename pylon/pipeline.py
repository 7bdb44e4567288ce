"""The request pipeline's pure core: validate, sanitize, derive, plan.

A tunnel request head becomes a `RequestPlan`: the route's class, the parsed
tunnel headers, the headers that may reach the engine (hop-by-hop, tunnel-only,
the tunnel credential and every deny-listed name removed; in allowlist mode
only allowed names kept; Pylon's derived headers and the one validated
x-request-id added), and what to do with the body. No I/O here: the service
edge reads bodies and calls `sanitize_body` when the plan says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from backends.base import BackendAdapter, Derived, RouteClass
from backends.priority import PriorityPolicy, normalize_level
from backends.sanitize import BodyRejected, rewrite_json_body, strip_headers
from pylon.errors import BodyInvalid, RouteNotAllowed
from pylon.tunnel_headers import (
    REQUEST_ID,
    TunnelHeaders,
    parse_tunnel_headers,
    strip_hop_by_hop,
    strip_tunnel_headers,
)
from tunnel.types import RequestHead

CREDENTIAL_HEADERS = frozenset({b"authorization"})
"""The tunnel's bearer token: checked by Pylon, never forwarded, whatever the config."""

FIELD_OVERHEAD_BYTES = 32
"""RFC 9114 §4.2.2 sizes a field section as HTTP/2 does: name + value + 32 per
field, so a flood of tiny fields counts too."""


class Derivation(StrEnum):
    """Why a request did or did not get an engine priority (a bounded metric label)."""

    EMITTED = "emitted"
    ABSENT_NORMALIZED = "absent_normalized"
    ABSENT_OMITTED = "absent_omitted"
    DISABLED = "disabled"
    NOT_APPLICABLE = "not_applicable"


@dataclass(frozen=True)
class PipelineOptions:
    policy: PriorityPolicy
    derive_priority: bool
    extra_health_paths: frozenset[str] = frozenset()
    allowed_headers: frozenset[bytes] | None = None
    """Allowlist mode: only these (lowercase) inbound names are forwarded; None
    (denylist mode) forwards every name the deny-lists leave."""


@dataclass(frozen=True)
class RequestPlan:
    route_class: RouteClass
    tunnel: TunnelHeaders
    headers: tuple[tuple[bytes, bytes], ...]
    """Headers to send to the engine."""
    stripped_headers: tuple[str, ...]
    """Deny-list entries that matched inbound headers (spoof attempts)."""
    derived: Derived
    derivation: Derivation
    rewrite_body: bool
    """Body must be buffered, checked as a JSON object and rewritten."""


def classify_route(
    adapter: BackendAdapter, head: RequestHead, extra_health_paths: frozenset[str]
) -> RouteClass:
    route_class = adapter.route_class(head.method, head.path)
    if route_class is not None:
        return route_class
    if head.method == "GET" and head.path.split("?", 1)[0] in extra_health_paths:
        return RouteClass.HEALTH
    raise RouteNotAllowed(f"{head.method} {head.path.split('?', 1)[0]} is not reachable")


def plan_request(
    head: RequestHead,
    *,
    adapter: BackendAdapter,
    options: PipelineOptions,
    route_class: RouteClass | None = None,
) -> RequestPlan:
    """Plan a request; `route_class` may be passed when the caller already classified it."""
    if route_class is None:
        route_class = classify_route(adapter, head, options.extra_health_paths)
    is_health = route_class is RouteClass.HEALTH
    tunnel = parse_tunnel_headers(head.headers, require_request_id=not is_health)
    derivation, derived = _derive(adapter, route_class, tunnel, options)
    inbound = strip_credentials(strip_tunnel_headers(strip_hop_by_hop(head.headers)))
    sanitized = strip_headers(adapter, inbound)
    forwarded = apply_header_policy(sanitized.headers, options.allowed_headers)
    headers = [*forwarded, *derived.headers]
    if tunnel.request_id is not None:
        headers.append((REQUEST_ID, tunnel.request_id.encode("ascii")))
    return RequestPlan(
        route_class=route_class,
        tunnel=tunnel,
        headers=tuple(headers),
        stripped_headers=sanitized.stripped,
        derived=derived,
        derivation=derivation,
        rewrite_body=adapter.rewrites_body(route_class),
    )


def strip_credentials(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in headers if name.lower() not in CREDENTIAL_HEADERS]


def apply_header_policy(
    headers: Iterable[tuple[bytes, bytes]], allowed: frozenset[bytes] | None
) -> list[tuple[bytes, bytes]]:
    """Allowlist mode keeps only allowed names; denylist mode (None) keeps all."""
    if allowed is None:
        return list(headers)
    return [(name, value) for name, value in headers if name.lower() in allowed]


def header_section_size(head: RequestHead) -> int:
    """The request head's size as RFC 9114 §4.2.2 counts it, pseudo-headers included."""
    size = len(":method:scheme:path") + len(head.method) + len(head.scheme) + len(head.path)
    fields = 3 + len(head.headers)
    if head.authority:
        size += len(":authority") + len(head.authority)
        fields += 1
    for name, value in head.headers:  # a loop, not sum(): every request is counted
        size += len(name) + len(value)
    return size + fields * FIELD_OVERHEAD_BYTES


def _derive(
    adapter: BackendAdapter,
    route_class: RouteClass,
    tunnel: TunnelHeaders,
    options: PipelineOptions,
) -> tuple[Derivation, Derived]:
    if route_class is not RouteClass.INFERENCE:
        return Derivation.NOT_APPLICABLE, Derived()
    if not options.derive_priority:
        return Derivation.DISABLED, Derived()
    # Adapters see absent-with-omit (level None) too: vLLM reads a missing
    # priority as its MOST urgent class, so its adapter still writes one.
    derived = adapter.derive(normalize_level(tunnel.priority, options.policy))
    emitted = derived.emitted_priority is not None
    if tunnel.priority is None:
        return (Derivation.ABSENT_NORMALIZED if emitted else Derivation.ABSENT_OMITTED), derived
    if not emitted:  # the engine takes no priority in this setup
        return Derivation.NOT_APPLICABLE, derived
    return Derivation.EMITTED, derived


def sanitize_body(
    adapter: BackendAdapter, plan: RequestPlan, raw: bytes
) -> tuple[bytes, tuple[str, ...]]:
    """Rewritten body and the deny-listed fields it had; BodyInvalid if not a JSON object."""
    try:
        rewrite = rewrite_json_body(adapter, raw, plan.derived)
    except BodyRejected as exc:
        raise BodyInvalid(f"request body must be a JSON object: {exc}") from exc
    return rewrite.body, rewrite.stripped
