"""The bench workloads as pure request templates: small, stream, upload, priority.

Strategy: a workload is a cycle of `RequestSpec`s; request number i of a run
uses `pattern[i % len(pattern)]` with its own `x-request-id` added by the
load generator. Mixed traffic (priority classes) is interleaved by smooth
weighted round-robin, so every short window of the run has the intended mix
instead of one class arriving in a burst.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import orjson

CHAT = "/v1/chat/completions"
MODEL = "mock-model"
PATTERN_LENGTH = 100
"""Class-mix resolution: shares are honoured to 1 % of the requests."""
STREAM_TRAILER_EVENTS = 2
"""A streamed chat completion ends with a finish-reason chunk and `data: [DONE]`."""
JSON = ("content-type", "application/json")


@dataclass(frozen=True)
class RequestSpec:
    """One request template (the load generator adds x-request-id and content-length)."""

    label: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    expected_events: int | None = None
    """`data:` events of a complete stream; None for a non-streaming request."""


@dataclass(frozen=True)
class PriorityClass:
    label: str
    priority: int | None
    """The x-priority value; None = unconfigured traffic (no header)."""
    share: float
    """Offered load as a fraction of the engine's capacity."""


def _chat_body(tokens: int, *, stream: bool, content: str = "hi") -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "stream": stream,
    }
    return orjson.dumps(body)


def small(*, tokens: int = 16) -> tuple[RequestSpec, ...]:
    """A non-streaming chat completion: the per-request cost of the path."""
    return (RequestSpec("all", "POST", CHAT, (JSON,), _chat_body(tokens, stream=False)),)


def stream(*, tokens: int = 100) -> tuple[RequestSpec, ...]:
    """An SSE chat completion of `tokens` tokens (the engine sets the token rate)."""
    body = _chat_body(tokens, stream=True)
    return (RequestSpec("all", "POST", CHAT, (JSON,), body, tokens + STREAM_TRAILER_EVENTS),)


def upload(*, body_bytes: int = 1 << 20) -> tuple[RequestSpec, ...]:
    """A large prompt (about `body_bytes` of JSON) with a one-token answer."""
    filler = "x" * max(body_bytes - len(_chat_body(1, stream=False)), 0)
    body = _chat_body(1, stream=False, content=filler)
    return (RequestSpec("all", "POST", CHAT, (JSON,), body),)


def priority(classes: Sequence[PriorityClass], *, tokens: int) -> tuple[RequestSpec, ...]:
    """Streamed completions from several priority classes, interleaved by share."""
    body = _chat_body(tokens, stream=True)
    by_label = {c.label: c for c in classes}
    order = interleave([(c.label, c.share) for c in classes], PATTERN_LENGTH)
    specs = []
    for label in order:
        level = by_label[label].priority
        headers = (JSON,) if level is None else (JSON, ("x-priority", str(level)))
        specs.append(
            RequestSpec(label, "POST", CHAT, headers, body, tokens + STREAM_TRAILER_EVENTS)
        )
    return tuple(specs)


def with_headers(
    pattern: Sequence[RequestSpec], headers: Sequence[tuple[str, str]]
) -> tuple[RequestSpec, ...]:
    """The same requests with extra headers (e.g. `x-priority`) on every one."""
    return tuple(replace(spec, headers=(*spec.headers, *headers)) for spec in pattern)


def interleave(weights: Sequence[tuple[str, float]], length: int) -> list[str]:
    """Smooth weighted round-robin (nginx's): `length` picks, each label ~ its share."""
    if not weights or any(w <= 0 for _, w in weights):
        raise ValueError("every class needs a positive share")
    total = sum(w for _, w in weights)
    current = [0.0] * len(weights)
    picks = []
    for _ in range(length):
        current = [c + w for c, (_, w) in zip(current, weights, strict=True)]
        best = max(range(len(weights)), key=lambda i: current[i])
        current[best] -= total
        picks.append(weights[best][0])
    return picks


UNCONFIGURED = ("none", "-", "unconfigured")


def parse_classes(text: str) -> tuple[PriorityClass, ...]:
    """ "0:0.15,990:0.8,none:0.3" -> classes; `none` (or `-`) is traffic without x-priority."""
    classes = []
    for item in text.split(","):
        level, sep, share = item.strip().partition(":")
        if not sep:
            raise ValueError(f"class {item!r} is not PRIORITY:SHARE")
        if level in UNCONFIGURED:
            classes.append(PriorityClass("unconfigured", None, float(share)))
        elif level.isdigit():
            classes.append(PriorityClass(f"p{int(level)}", int(level), float(share)))
        else:
            raise ValueError(f"priority {level!r} is not an unsigned integer or 'none'")
    if any(not c.share > 0 for c in classes):
        raise ValueError("every class needs a positive share")
    if len({c.label for c in classes}) != len(classes):
        raise ValueError("each priority class may appear once")
    return tuple(classes)
