"""Typed values that cross the tunnel edge: a validated request head, errors.

The tunnel knows HTTP/3 and nothing of engines: a request head is method,
scheme, authority, path and the regular header fields exactly as received
(lowercase names, raw values, duplicates kept in order).
"""

from __future__ import annotations

from dataclasses import dataclass

HeaderList = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class RequestHead:
    method: str
    """Request method, e.g. "POST"."""
    scheme: str
    """`:scheme` pseudo-header, usually "https"."""
    authority: str
    """`:authority` pseudo-header (may be empty for non-http schemes)."""
    path: str
    """`:path` pseudo-header, query string included."""
    headers: HeaderList
    """Regular header fields in arrival order (pseudo-headers removed)."""


class StreamAborted(Exception):
    """The peer reset or stopped the stream; nothing more can be sent or received."""

    def __init__(self, error_code: int) -> None:
        super().__init__(f"stream aborted by peer (error code {error_code:#x})")
        self.error_code = error_code


class MalformedRequest(Exception):
    """A request head that violates RFC 9114 §4.1.2; fails only its own stream."""
