"""The backend adapter interface: one contract toward the gateway, one engine behind it.

Strategy: an adapter is a table of facts about one engine (routes reachable
through the tunnel, header deny-list, body fields to remove, what Pylon writes
itself) plus one pure function, `derive`, that turns the normalized platform
priority level into that engine's native form. Everything here is pure: no
I/O, no clock, no config loading. The generic table-driven work (stripping
headers, rewriting bodies) lives once in `backends.sanitize`; adapters only
supply tables and `derive`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from backends.priority import PriorityPolicy

Headers = list[tuple[bytes, bytes]]
"""Header list as carried at the HTTP/3 edge: (name, value) byte pairs."""

BodyPath = tuple[str, ...]
"""Path of keys into a JSON object, e.g. ("nvext", "agent_hints", "priority")."""


class RouteClass(StrEnum):
    """What a route reachable through the tunnel is for (a bounded metric label)."""

    INFERENCE = "inference"
    MODELS = "models"
    HEALTH = "health"


@dataclass(frozen=True)
class Derived:
    """What an adapter writes for one request after sanitizing."""

    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Headers to set (any inbound copy of the same name was already removed)."""
    body_fields: Mapping[BodyPath, Any] = field(default_factory=dict)
    """Body fields to set, by path, after the deny-listed fields were removed."""
    emitted_priority: int | None = None
    """The engine-native priority value written, for logs and metrics."""


@dataclass(frozen=True)
class SanitizedHeaders:
    headers: Headers
    """Headers that may reach the engine (names lowercased)."""
    stripped: tuple[str, ...]
    """Deny-list entries (names, or prefix patterns like ``x-override-*``) that matched."""


# Routing headers only a trusted router (llm-d / Gateway API Inference
# Extension) may set; no engine should receive them from a caller.
TRUSTED_ROUTER_HEADERS: frozenset[str] = frozenset(
    {
        "x-prefiller-host-port",
        "x-encoder-hosts-ports",
        "x-data-parallel-host-port",
        "x-kv-cache-source-host-port",
        "x-data-parallel-rank",
    }
)
TRUSTED_ROUTER_HEADER_PREFIXES: tuple[str, ...] = ("x-gateway-destination-endpoint",)


def prefix_pattern(prefix: str) -> str:
    """How a prefix family is written in labels and docs: ``x-override-`` -> ``x-override-*``."""
    return prefix + "*"


def dotted(path: BodyPath) -> str:
    """How a body path is written in labels and docs: ``nvext.agent_hints.priority``."""
    return ".".join(path)


class BackendAdapter:
    """Base adapter: subclasses fill the class tables and override `derive`.

    Subclasses set:
      name: the `backend.type` value.
      routes: (METHOD, path) -> RouteClass; everything else answers 404.
      denied_headers / denied_header_prefixes: engine-specific deny-list
        (the trusted-router list is always added; the tunnel headers and
        hop-by-hop fields are the pipeline's, removed before adapters run).
      derived_headers: headers `derive` may write (always stripped inbound).
      denied_body_fields: JSON paths removed from inference bodies.
      derived_body_fields: JSON paths `derive` may write (always removed first).
    """

    name: ClassVar[str] = "base"
    routes: ClassVar[Mapping[tuple[str, str], RouteClass]] = {}
    denied_headers: ClassVar[frozenset[str]] = frozenset()
    denied_header_prefixes: ClassVar[tuple[str, ...]] = ()
    derived_headers: ClassVar[frozenset[str]] = frozenset()
    denied_body_fields: ClassVar[tuple[BodyPath, ...]] = ()
    derived_body_fields: ClassVar[tuple[BodyPath, ...]] = ()

    def __init__(self, policy: PriorityPolicy | None = None) -> None:
        # The shared priority policy: adapters that invert polarity need its ceiling.
        self.policy = policy if policy is not None else PriorityPolicy()
        # The tables are constant: combine them once, not on every request.
        self._denied_headers = self.denied_headers | TRUSTED_ROUTER_HEADERS
        self._denied_prefixes = self.denied_header_prefixes + TRUSTED_ROUTER_HEADER_PREFIXES
        extra = tuple(p for p in self.derived_body_fields if p not in self.denied_body_fields)
        self._denied_body_fields = self.denied_body_fields + extra

    def route_class(self, method: str, path: str) -> RouteClass | None:
        """Route class for a request, or None when the route is not reachable.

        The query string is ignored for the match; the path must match exactly,
        so encoded or doubled slashes never reach an admin route by accident.
        """
        bare_path = path.split("?", 1)[0]
        return self.routes.get((method.upper(), bare_path))

    def rewrites_body(self, route_class: RouteClass) -> bool:
        """Whether requests of this class carry a JSON body that must be rewritten."""
        return route_class is RouteClass.INFERENCE and bool(self.all_denied_body_fields())

    def all_denied_headers(self) -> frozenset[str]:
        """The engine's deny-list plus the trusted-router names."""
        return self._denied_headers

    def all_denied_header_prefixes(self) -> tuple[str, ...]:
        return self._denied_prefixes

    def derived_header_names(self) -> frozenset[str]:
        """Headers `derive` may write; always stripped from the inbound request."""
        return self.derived_headers

    def all_denied_body_fields(self) -> tuple[BodyPath, ...]:
        """Body paths removed before `derive` writes: the deny-list, then derived paths.

        Derived paths are removed even when `derive` emits nothing, so a client
        value can never stand in for Pylon's.
        """
        return self._denied_body_fields

    def derive(self, level: int | None) -> Derived:
        """Engine-native priority for a normalized level (None: emit nothing)."""
        return Derived()
