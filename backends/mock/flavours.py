"""Per-engine rules of the mock engines, as tables plus one resolver per engine.

Strategy: everything that differs between Dynamo, vLLM, SGLang and the
generic OpenAI server lives in one `Flavour` value: its routes, the headers
and body fields it reads for priority and routing, its error shape, and a
pure function (headers, body, options) -> `Resolution` that applies the
engine's own precedence rules (see /work/shared/spec/engines.md). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backends.mock.inputs import (
    I32,
    U32,
    HeaderList,
    RejectedError,
    body_float,
    body_get,
    body_int,
    first_header,
    is_missing,
    parse_python_int,
    parse_rust_int,
)
from backends.mock.options import MockEngineOptions
from backends.mock.tables import (
    DYNAMO_NVEXT_KEYS,
    DYNAMO_TOP_LEVEL_FIELDS,
    TABLES,
    InputTable,
)

Body = Mapping[str, Any]


@dataclass(frozen=True)
class Resolution:
    """The priority the real engine would use for one request."""

    priority: int | None
    """Resolved priority; None = none (or ignored by the engine)."""
    source: str
    """Where it came from: "header", "body", "default", "ignored" or "none"."""
    strict_priority: int | None = None
    """Dynamo router queue tier (compared before the soft priority)."""
    jump: float | None = None
    """Dynamo: latency_sensitivity used as the router jump when no priority exists."""

    def to_json(self) -> dict[str, Any]:
        return {
            "priority": self.priority,
            "source": self.source,
            "strict_priority": self.strict_priority,
            "jump": self.jump,
        }


Resolver = Callable[[HeaderList, Body, MockEngineOptions], Resolution]
ErrorShape = Callable[[int, str], dict[str, Any]]

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    529: "OverloadedError",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "Error")


def dynamo_error(status: int, message: str) -> dict[str, Any]:
    return {"message": message, "type": error_type(status), "code": status}


def nested_error(status: int, message: str) -> dict[str, Any]:
    """vLLM's (and OpenAI's) shape."""
    body = {"message": message, "type": error_type(status), "param": None, "code": status}
    return {"error": body}


def sglang_error(status: int, message: str) -> dict[str, Any]:
    return {
        "object": "error",
        "message": message,
        "type": error_type(status),
        "param": None,
        "code": status,
    }


def _header_or_body(header: int | None, body: int | None) -> tuple[int | None, str]:
    if header is not None:
        return header, "header"
    if body is not None:
        return body, "body"
    return None, "none"


def resolve_dynamo(headers: HeaderList, body: Body, _opts: MockEngineOptions) -> Resolution:
    """Each field independently: a well-formed header wins, else the body's agent_hints."""
    validate_dynamo(body)
    hints = "nvext.agent_hints."
    h_prio = parse_rust_int(first_header(headers, "x-dynamo-request-priority"), I32)
    h_strict = parse_rust_int(first_header(headers, "x-dynamo-request-strict-priority"), U32)
    priority, source = _header_or_body(h_prio, body_int(body, hints + "priority", I32))
    strict, _ = _header_or_body(h_strict, body_int(body, hints + "strict_priority", U32))
    sensitivity = body_float(body, hints + "latency_sensitivity")
    jump = sensitivity if priority is None else None
    return Resolution(priority, source, strict_priority=strict, jump=jump)


def validate_dynamo(body: Body) -> None:
    """Dynamo's serde structs deny unknown top-level fields and unknown nvext keys."""
    unknown = sorted(set(body) - DYNAMO_TOP_LEVEL_FIELDS)
    if unknown:
        raise RejectedError(400, f"unknown field `{unknown[0]}`")
    nvext = body_get(body, "nvext")
    if is_missing(nvext) or nvext is None:
        return
    if not isinstance(nvext, Mapping):
        raise RejectedError(400, "nvext: expected an object")
    unknown = sorted(set(nvext) - DYNAMO_NVEXT_KEYS)
    if unknown:
        raise RejectedError(400, f"nvext: unknown field `{unknown[0]}`")
    hints = nvext.get("agent_hints")
    if hints is not None and not isinstance(hints, Mapping):
        raise RejectedError(400, "nvext.agent_hints: expected an object")


def resolve_vllm(headers: HeaderList, body: Body, opts: MockEngineOptions) -> Resolution:
    """Body `priority` (default 0); a header that parses as int overrides; fcfs ignores."""
    from_body = body_int(body, "priority", None)
    from_header = parse_python_int(first_header(headers, "x-vllm-priority"))
    if opts.vllm_scheduling_policy != "priority":
        return Resolution(None, "ignored")
    priority, source = _header_or_body(from_header, from_body)
    if priority is None:
        return Resolution(0, "default")
    return Resolution(priority, source)


def resolve_sglang(headers: HeaderList, body: Body, opts: MockEngineOptions) -> Resolution:
    """Body `priority`; `x-override-priority` only with header overrides enabled."""
    priority = body_int(body, "priority", None)
    source = "body" if priority is not None else "none"
    if opts.sglang_header_overrides:
        override = parse_python_int(first_header(headers, "x-override-priority"))
        if override is not None:
            priority, source = override, "header"
    if not opts.sglang_priority_scheduling:
        if priority is not None and opts.sglang_abort_on_priority_when_disabled:
            raise RejectedError(503, "priority is not enabled on this server")
        return Resolution(None, "ignored")
    if priority is None and opts.sglang_default_priority is not None:
        return Resolution(opts.sglang_default_priority, "default")
    return Resolution(priority, source)


def resolve_openai(_headers: HeaderList, _body: Body, _opts: MockEngineOptions) -> Resolution:
    """The generic server has no priority: it only records what arrived."""
    return Resolution(None, "none")


@dataclass(frozen=True)
class Flavour:
    """Everything engine-specific about one mock engine."""

    name: str
    inference_routes: frozenset[str]
    health_routes: frozenset[str]
    error_shape: ErrorShape
    resolve: Resolver
    table: InputTable
    echo_request_id: bool
    """Whether the inbound x-request-id is echoed on the response."""
    keep_alive_comment: bool
    """Whether an SSE `: keep-alive` comment precedes the first token."""

    def priority_inputs(self, headers: HeaderList, body: Body) -> dict[str, Any]:
        return self.table.priority.collect(headers, body)

    def routing_inputs(self, headers: HeaderList, body: Body) -> dict[str, Any]:
        return self.table.routing.collect(headers, body)


_OPENAI_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
)
_SGLANG_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate"}
)

FLAVOURS: dict[str, Flavour] = {
    "openai": Flavour(
        "openai", _OPENAI_ROUTES, frozenset({"/health"}), nested_error, resolve_openai,
        TABLES["openai"], echo_request_id=True, keep_alive_comment=False,
    ),
    "dynamo": Flavour(
        "dynamo", _OPENAI_ROUTES, frozenset({"/health", "/live"}), dynamo_error,
        resolve_dynamo, TABLES["dynamo"], echo_request_id=True, keep_alive_comment=False,
    ),
    "vllm": Flavour(
        "vllm", _OPENAI_ROUTES, frozenset({"/health", "/ping"}), nested_error, resolve_vllm,
        TABLES["vllm"], echo_request_id=False, keep_alive_comment=True,
    ),
    "sglang": Flavour(
        "sglang", _SGLANG_ROUTES,
        frozenset({"/health", "/health_generate", "/ready", "/ping"}), sglang_error,
        resolve_sglang, TABLES["sglang"], echo_request_id=False, keep_alive_comment=False,
    ),
}  # fmt: skip
"""Flavour by engine name (dispatch by table)."""
