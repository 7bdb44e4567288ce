"""The tunnel headers, parsed once into a typed value; hop-by-hop removal.

Every later stage uses `TunnelHeaders`; nothing parses `x-priority` again.
Absent priority stays `None` (unconfigured), which is NOT the same as 0 (the
most urgent). Note `x-priority` is the platform priority, unrelated to the
RFC 9218 `priority` header a tunnel may also carry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pylon.errors import BadTunnelHeader

REQUEST_ID = b"x-request-id"
PRIORITY = b"x-priority"
EXPECTED_QUEUE_MS = b"x-stargate-expected-queue-ms"

MAX_REQUEST_ID_LENGTH = 128
_VISIBLE_ASCII = bytes(range(0x21, 0x7F))
"""The bytes a request id may hold; deleting them (`bytes.translate`) leaves none."""
U32_MAX = 2**32 - 1
_U32_DIGITS = 10

TUNNEL_ONLY_HEADERS = frozenset({PRIORITY, EXPECTED_QUEUE_MS, REQUEST_ID})
"""Consumed by Pylon; x-request-id is re-added once, from the parsed value."""

HOP_BY_HOP_HEADERS = frozenset(
    {
        # RFC 9110 §7.6.1 and RFC 9114 §4.2 connection-specific fields.
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"upgrade",
        b"te",
        b"trailer",
        b"proxy-authenticate",
        b"proxy-authorization",
        # Framing and addressing belong to each hop: httpx sets them upstream.
        b"host",
        b"content-length",
    }
)


@dataclass(frozen=True)
class TunnelHeaders:
    request_id: str | None
    """Validated x-request-id; None only on health requests that omit it."""
    priority: int | None
    """Platform priority (u32, lower = more urgent); None when absent."""


def parse_tunnel_headers(
    headers: Iterable[tuple[bytes, bytes]], *, require_request_id: bool
) -> TunnelHeaders:
    request_ids: list[bytes] = []
    priorities: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == REQUEST_ID:
            request_ids.append(value)
        elif lowered == PRIORITY:
            priorities.append(value)
    return TunnelHeaders(
        request_id=_request_id(request_ids, required=require_request_id),
        priority=_priority(priorities),
    )


def _request_id(values: list[bytes], *, required: bool) -> str | None:
    if len(values) > 1:
        raise BadTunnelHeader("x-request-id must appear once")
    if not values:
        if required:
            raise BadTunnelHeader("x-request-id is required")
        return None
    value = values[0]
    if not 1 <= len(value) <= MAX_REQUEST_ID_LENGTH or value.translate(None, _VISIBLE_ASCII):
        raise BadTunnelHeader("x-request-id must be 1..128 visible ASCII characters")
    return value.decode("ascii")


def parse_priority_value(value: bytes) -> int:
    """Decimal u32 with surrounding whitespace trimmed; anything else is rejected."""
    digits = value.strip(b" \t")
    if not digits or len(digits) > _U32_DIGITS or not digits.isdigit():
        raise BadTunnelHeader("x-priority must be a decimal integer in 0..4294967295")
    number = int(digits)
    if number > U32_MAX:
        raise BadTunnelHeader("x-priority must be a decimal integer in 0..4294967295")
    return number


def _priority(values: list[bytes]) -> int | None:
    if len(values) > 1:
        raise BadTunnelHeader("x-priority must appear at most once")
    return parse_priority_value(values[0]) if values else None


def strip_hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Drop connection-specific fields, including any named in a Connection header."""
    header_list = [(name.lower(), value) for name, value in headers]
    named = {
        token.strip().lower()
        for name, value in header_list
        if name == b"connection"
        for token in value.split(b",")
    }
    dropped = HOP_BY_HOP_HEADERS | named
    return [(name, value) for name, value in header_list if name not in dropped]


def strip_tunnel_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in headers if name.lower() not in TUNNEL_ONLY_HEADERS]
