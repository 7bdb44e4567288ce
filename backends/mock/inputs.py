"""Pure helpers over one request's inputs: header lookup, body paths, integer parsing.

Strategy: headers arrive as h11 gives them (lowercase names, every value in
order, duplicates kept) decoded to `str`; bodies are parsed JSON objects.
Integer parsing follows each engine's language: Dynamo is Rust
(`str::parse::<i32>` after `trim()`: optional sign, ASCII digits, range
checked), vLLM and SGLang are Python (`int(value)`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

HeaderList = tuple[tuple[str, str], ...]
"""(lowercase name, value) pairs in arrival order, duplicates kept."""

I32 = (-(2**31), 2**31 - 1)
U32 = (0, 2**32 - 1)
_RUST_INT = re.compile(r"[+-]?[0-9]+\Z")

_MISSING = object()


@dataclass(frozen=True)
class Rejection:
    """The engine refuses the request before it is queued."""

    status: int
    message: str


class RejectedError(Exception):
    """Raised by a flavour's parser; carries the status and message to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.rejection = Rejection(status, message)


def first_header(headers: HeaderList, name: str) -> str | None:
    """The first value of `name`, as http's HeaderMap::get and Starlette's get do."""
    for key, value in headers:
        if key == name:
            return value
    return None


def headers_matching(
    headers: HeaderList, names: Iterable[str], prefixes: Iterable[str] = ()
) -> dict[str, list[str]]:
    """Every value of every header named in `names` or starting with a prefix."""
    wanted = frozenset(names)
    starts = tuple(prefixes)
    found: dict[str, list[str]] = {}
    for key, value in headers:
        if key in wanted or (starts and key.startswith(starts)):
            found.setdefault(key, []).append(value)
    return found


def body_get(body: Mapping[str, Any], path: str) -> Any:
    """Value at a dotted path ("nvext.agent_hints.priority"), or the _MISSING sentinel."""
    node: Any = body
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


def is_missing(value: Any) -> bool:
    return value is _MISSING


def body_matching(body: Mapping[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """The body fields present at `paths`, keyed by dotted path."""
    found: dict[str, Any] = {}
    for path in paths:
        value = body_get(body, path)
        if not is_missing(value):
            found[path] = value
    return found


def parse_rust_int(text: str | None, bounds: tuple[int, int]) -> int | None:
    """Rust `text.trim().parse::<iN/uN>()`: None when missing or malformed."""
    if text is None:
        return None
    trimmed = text.strip()
    if not _RUST_INT.match(trimmed):
        return None
    value = int(trimmed)
    if bounds[0] <= value <= bounds[1]:
        return value
    return None


def parse_python_int(text: str | None) -> int | None:
    """Python `int(text)` (whitespace, sign, underscores allowed); None when it raises."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def is_json_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def body_int(body: Mapping[str, Any], path: str, bounds: tuple[int, int] | None) -> int | None:
    """A typed integer body field: None when absent/null, 400 when of the wrong type."""
    value = body_get(body, path)
    if is_missing(value) or value is None:
        return None
    if not is_json_int(value) or (bounds and not bounds[0] <= value <= bounds[1]):
        raise RejectedError(400, f"{path}: expected an integer, got {value!r}")
    return int(value)


def body_float(body: Mapping[str, Any], path: str) -> float | None:
    value = body_get(body, path)
    if is_missing(value) or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RejectedError(400, f"{path}: expected a number, got {value!r}")
    return float(value)
