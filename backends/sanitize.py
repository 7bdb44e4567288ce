"""Table-driven sanitizing: the one implementation every adapter's tables feed.

Strategy: two pure functions over bytes and an adapter's tables. Headers are
filtered by exact name, prefix family, or derived name, compared on the ASCII
lowercase of the raw name bytes (the way every engine's HTTP parser compares
them). JSON bodies are parsed, stripped of deny-listed paths, given the
adapter's derived fields, and re-serialized: the engine only ever parses
Pylon's serialization, so duplicate keys or odd encodings in the client's
bytes cannot make the engine see something the sanitizer did not. Size limits
are the caller's job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from backends.base import (
    BackendAdapter,
    BodyPath,
    Derived,
    Headers,
    SanitizedHeaders,
    dotted,
    prefix_pattern,
)

__all__ = ["BodyRejected", "BodyRewrite", "rewrite_json_body", "strip_headers"]

_WIDE_NUMBER = re.compile(rb"[0-9]{19}")
"""orjson silently reads integers outside i64/u64 as floats (19 digits is the
shortest such literal): a body with any 19-digit run goes to the stdlib parser,
which keeps them exact. Digits inside strings only cost the slower parser."""

BodyRejectReason = Literal["invalid_json", "not_object"]
"""Bounded set: these become error codes and metric labels."""


class BodyRejected(Exception):
    """A body that must be sanitized could not be; it is never forwarded (400)."""

    def __init__(self, reason: BodyRejectReason, message: str) -> None:
        super().__init__(message)
        self.reason: BodyRejectReason = reason
        self.message = message


@dataclass(frozen=True)
class BodyRewrite:
    body: bytes
    """The serialized JSON object to forward."""
    stripped: tuple[str, ...]
    """Deny-listed fields (dotted paths) the client had sent, in deny-list order."""


def strip_headers(adapter: BackendAdapter, headers: Headers) -> SanitizedHeaders:
    """Drop every header the engine must not receive from a caller.

    Derived names are removed too: Pylon sets them afterwards, and an engine
    reading the first value must only ever see Pylon's.
    """
    exact = adapter.all_denied_headers() | adapter.derived_header_names()
    prefixes = adapter.all_denied_header_prefixes()
    kept: Headers = []
    matched: set[str] = set()
    for raw_name, value in headers:
        name = raw_name.lower()
        entry = _deny_entry(name.decode("latin-1"), exact=exact, prefixes=prefixes)
        if entry is None:
            kept.append((name, value))
        else:
            matched.add(entry)
    return SanitizedHeaders(headers=kept, stripped=tuple(sorted(matched)))


def _deny_entry(name: str, *, exact: frozenset[str], prefixes: tuple[str, ...]) -> str | None:
    """The deny-list entry a lowercased name matches (a fixed label), or None."""
    if name in exact:
        return name
    for prefix in prefixes:
        if name.startswith(prefix):
            return prefix_pattern(prefix)
    return None


def rewrite_json_body(adapter: BackendAdapter, raw: bytes, derived: Derived) -> BodyRewrite:
    """Remove the adapter's denied body paths, set the derived ones, re-serialize.

    Raises BodyRejected for anything that is not one JSON object, so an
    unsanitizable body is never forwarded as is.
    """
    document, by_stdlib = _parse_object(raw)
    stripped = tuple(
        dotted(path) for path in adapter.all_denied_body_fields() if _remove(document, path)
    )
    _set_all(document, derived.body_fields)
    return BodyRewrite(body=_serialize(document, by_stdlib=by_stdlib), stripped=stripped)


def _parse_object(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The object, and whether only the stdlib could parse it.

    orjson first; the stdlib for what only it reads faithfully (integers beyond
    64 bits, NaN/Infinity, UTF-16/32), as the Python engines themselves do.
    """
    if _WIDE_NUMBER.search(raw):
        return _require_object(_parse_stdlib(raw)), True
    try:
        return _require_object(orjson.loads(raw)), False
    except orjson.JSONDecodeError:
        return _require_object(_parse_stdlib(raw)), True


def _require_object(document: Any) -> dict[str, Any]:
    if not isinstance(document, dict):
        raise BodyRejected("not_object", "request body must be a JSON object")
    return document


def _parse_stdlib(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeError are ValueErrors
        raise BodyRejected("invalid_json", "request body is not valid JSON") from exc


def _serialize(document: dict[str, Any], *, by_stdlib: bool) -> bytes:
    """Serialize with the codec that parsed, so what only the stdlib reads (big
    integers, NaN) is kept as sent; ASCII-escaped so lone surrogates survive."""
    if not by_stdlib:
        try:
            return orjson.dumps(document)
        except orjson.JSONEncodeError:
            pass  # a derived value orjson cannot encode: the stdlib can
    try:
        return json.dumps(document, separators=(",", ":")).encode("ascii")
    except (ValueError, RecursionError) as exc:
        raise BodyRejected("invalid_json", "request body cannot be re-encoded") from exc


# `document` below is always the object `_parse_object` just built for this
# call, so editing it in place is invisible to the caller.


def _remove(document: dict[str, Any], path: BodyPath) -> bool:
    """Remove `path` if present; a non-object on the way leaves the body alone."""
    parent: Any = document
    for key in path[:-1]:
        parent = parent.get(key)
        if not isinstance(parent, dict):
            return False
    if path[-1] not in parent:
        return False
    del parent[path[-1]]
    return True


def _set_all(document: dict[str, Any], fields: Mapping[BodyPath, Any]) -> None:
    for path, value in fields.items():
        _set(document, path, value)


def _set(document: dict[str, Any], path: BodyPath, value: Any) -> None:
    """Set `path`, creating objects on the way; a non-object there is replaced,
    because Pylon is the only writer of derived paths."""
    parent = document
    for key in path[:-1]:
        child = parent.get(key)
        if not isinstance(child, dict):
            child = {}
            parent[key] = child
        parent = child
    parent[path[-1]] = value
