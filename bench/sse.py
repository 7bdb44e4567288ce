"""Pure response observer: first byte, SSE `data:` events and the gaps between them.

Strategy: the driver feeds each body chunk with the time it arrived (`now`
is a parameter; nothing here reads a clock). Events are counted across chunk
boundaries: an event is a block ended by a blank line that has a `data:`
line, as the SSE spec frames it; comments (`: keep-alive`) are not events.
Several events in one chunk arrived together, so their gaps are 0: a proxy
that batches tokens shows up in the gap percentiles.
"""

from __future__ import annotations

EVENT_END = b"\n\n"
DATA_PREFIX = b"data:"


class StreamObserver:
    """Accumulates what one response looked like on the wire."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.first_byte_s: float | None = None
        self.first_event_s: float | None = None
        self.last_event_s: float | None = None
        self.last_chunk_s: float | None = None
        self.bytes = 0
        self.events = 0
        self.gaps_s: list[float] = []
        self._tail = b""

    def feed(self, chunk: bytes, now: float) -> None:
        if not chunk:
            return
        if self.first_byte_s is None:
            self.first_byte_s = now
        self.last_chunk_s = now
        self.bytes += len(chunk)
        for _ in range(self._complete_events(chunk)):
            self._event(now)

    def _complete_events(self, chunk: bytes) -> int:
        blocks = (self._tail + chunk).split(EVENT_END)
        self._tail = blocks.pop()
        return sum(1 for block in blocks if _has_data_line(block))

    def _event(self, now: float) -> None:
        if self.last_event_s is None:
            self.first_event_s = now
        else:
            self.gaps_s.append(now - self.last_event_s)
        self.last_event_s = now
        self.events += 1

    @property
    def ttfb_s(self) -> float | None:
        return None if self.first_byte_s is None else self.first_byte_s - self.start_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_event_s is None else self.first_event_s - self.start_s


def _has_data_line(block: bytes) -> bool:
    return any(line.startswith(DATA_PREFIX) for line in block.split(b"\n"))
