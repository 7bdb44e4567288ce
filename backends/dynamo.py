"""Dynamo adapter: header priority (higher wins) and the routing deny-list.

Owns every fact about what Dynamo's frontend reads from a caller, in the one
table below, and the mapping from a normalized platform level to Dynamo's two
priority headers. Dynamo resolves each priority input header-first, falling
back to `nvext.agent_hints` in the body when the header is missing or
malformed, so Pylon removes the body inputs and always writes both headers
well-formed. Routing headers are exact names (Dynamo reads exact names and
aliases); only `x-dynamo-meta-*` is a prefix, because Dynamo reads it by prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from backends.base import BackendAdapter, BodyPath, Derived, RouteClass
from backends.config import DynamoConfig
from backends.priority import PriorityPolicy

PRIORITY_HEADER = "x-dynamo-request-priority"
"""i32, higher wins: seconds of head start (FCFS) or a weight (WSPT)."""
STRICT_PRIORITY_HEADER = "x-dynamo-request-strict-priority"
"""u32 router queue tier, compared before the soft priority."""

# --- The Dynamo table (engines.md). Extend here when Dynamo adds an input. ---

DENIED_HEADERS: frozenset[str] = frozenset(
    {
        # worker / rank pinning: canonical name, then the aliases Dynamo honours
        "x-dynamo-worker-instance-id",
        "x-worker-instance-id",
        "x-dynamo-prefill-instance-id",
        "x-prefill-instance-id",
        "x-dynamo-dp-rank",
        "x-dp-rank",
        "x-data-parallel-rank",
        "x-dynamo-prefill-dp-rank",
        "x-prefill-dp-rank",
        # tenancy: sets the KV cache salt (cross-tenant cache probing)
        "x-tenant-id",
        # engine request identity (Pylon forwards only the tunnel's x-request-id)
        "request-id",
        "x-dynamo-request-id",
        # sessions
        "x-dynamo-session-id",
        "x-dynamo-parent-session-id",
        "x-dynamo-session-final",
    }
)
DENIED_HEADER_PREFIXES: tuple[str, ...] = ("x-dynamo-meta-",)
"""`x-dynamo-meta-policy-class` selects the router queue class; Dynamo reads
the whole family by prefix, so it is stripped by prefix."""
DERIVED_HEADERS: frozenset[str] = frozenset({PRIORITY_HEADER, STRICT_PRIORITY_HEADER})

_NVEXT_FIELDS: tuple[str, ...] = (
    "backend_instance_id",
    "decode_worker_id",
    "prefill_worker_id",
    "dp_rank",
    "prefill_dp_rank",
    "cache_salt",
    "routing_constraints",
    "router",
    "metadata_upload",
)
_AGENT_HINT_FIELDS: tuple[str, ...] = (
    "priority",
    "strict_priority",
    "latency_sensitivity",
    "speculative_prefill",
)
DENIED_BODY_FIELDS: tuple[BodyPath, ...] = (
    *(("nvext", key) for key in _NVEXT_FIELDS),
    *(("nvext", "agent_hints", key) for key in _AGENT_HINT_FIELDS),
    ("cache_salt",),
)
"""Headers can set a pin but never clear a body pin, so the body is rewritten."""

ROUTES: Mapping[tuple[str, str], RouteClass] = {
    ("POST", "/v1/chat/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/responses"): RouteClass.INFERENCE,
    ("POST", "/v1/embeddings"): RouteClass.INFERENCE,
    ("GET", "/v1/models"): RouteClass.MODELS,
    ("GET", "/health"): RouteClass.HEALTH,
    ("GET", "/live"): RouteClass.HEALTH,
}
"""Never reachable: /metrics, /busy_threshold, /openapi.json, /docs, RL/admin."""


class DynamoAdapter(BackendAdapter):
    name: ClassVar[str] = "dynamo"
    routes: ClassVar[Mapping[tuple[str, str], RouteClass]] = ROUTES
    denied_headers: ClassVar[frozenset[str]] = DENIED_HEADERS
    denied_header_prefixes: ClassVar[tuple[str, ...]] = DENIED_HEADER_PREFIXES
    derived_headers: ClassVar[frozenset[str]] = DERIVED_HEADERS
    denied_body_fields: ClassVar[tuple[BodyPath, ...]] = DENIED_BODY_FIELDS

    def __init__(
        self, config: DynamoConfig | None = None, policy: PriorityPolicy | None = None
    ) -> None:
        super().__init__(policy)
        self.config = config if config is not None else DynamoConfig()

    def derive(self, level: int | None) -> Derived:
        """Both headers, so no body value can win: soft priority `ceiling - level`
        (0 for the least urgent, never negative) and the configured strict tier."""
        if level is None:
            return Derived()
        priority = self.policy.ceiling - level
        headers = (
            (PRIORITY_HEADER.encode(), str(priority).encode()),
            (STRICT_PRIORITY_HEADER.encode(), str(self.strict_tier(level)).encode()),
        )
        return Derived(headers=headers, emitted_priority=priority)

    def strict_tier(self, level: int) -> int:
        """The first band whose `max_level` covers `level`, else `strict_priority`."""
        for band in self.config.strict_tier_bands:
            if level <= band.max_level:
                return band.tier
        return self.config.strict_priority
