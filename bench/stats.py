"""Pure statistics over bench records: percentiles, ratios, per-run summaries.

Strategy: no clocks, no I/O. A run is a list of `Record`s (one per request,
produced by the load generator) plus the wall time it took; `summarize`
turns that into one flat dict of numbers, the unit every later step (medians
over rounds, ratios between paths, tables, JSON) works on. Missing values are
`None`, never 0, so "not measured" cannot be mistaken for "free".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Summary = dict[str, float | int | None]


@dataclass(frozen=True)
class Record:
    """One request as the load generator saw it (times in seconds, monotonic clock)."""

    label: str
    """Traffic class (e.g. a priority class); "all" when the workload has one class."""
    request_id: str
    start_s: float
    """time.monotonic() when the request was sent: comparable across processes on Linux."""
    status: int | None = None
    """Response status; None when no response head arrived."""
    ttfb_s: float | None = None
    """Time to the first response body byte."""
    ttft_s: float | None = None
    """Time to the first SSE `data:` event (streams only)."""
    total_s: float | None = None
    """Time to the end of the response (None when it never ended cleanly)."""
    bytes: int = 0
    """Response body bytes received."""
    events: int = 0
    """SSE `data:` events received."""
    expected_events: int | None = None
    """Events a complete stream carries (None when not a stream)."""
    gaps_s: tuple[float, ...] = field(default=(), repr=False)
    """Time between consecutive `data:` events."""
    error: str | None = None
    """Why the request failed ("timeout", "reset:<code>", an exception name), or None."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and 200 <= self.status < 300


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float | int | None]) -> float | None:
    """Median of the values that are present; None when none are."""
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def difference(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None:
        return None
    return value - baseline


def _pcts(prefix: str, values: Sequence[float]) -> Summary:
    return {f"{prefix}_p50_s": percentile(values, 50), f"{prefix}_p99_s": percentile(values, 99)}


def summarize(records: Sequence[Record], *, wall_s: float) -> Summary:
    """Counts, throughput and latency percentiles of one run."""
    ok = [r for r in records if r.ok]
    gaps = [gap for r in ok for gap in r.gaps_s]
    streams = [r for r in records if r.expected_events is not None]
    lost = sum(max(r.expected_events - r.events, 0) for r in streams if r.expected_events)
    summary: Summary = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "wall_s": wall_s,
        "throughput_rps": ratio(len(ok), wall_s),
        "events": sum(r.events for r in records),
        "lost_events": lost if streams else None,
        "response_bytes": sum(r.bytes for r in records),
    }
    summary |= _pcts("ttfb", [r.ttfb_s for r in ok if r.ttfb_s is not None])
    summary |= _pcts("ttft", [r.ttft_s for r in ok if r.ttft_s is not None])
    summary |= _pcts("total", [r.total_s for r in ok if r.total_s is not None])
    summary |= _pcts("gap", gaps)
    return summary


def error_counts(records: Iterable[Record]) -> dict[str, int]:
    """How many requests failed, by error (or by status when the engine answered non-2xx)."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or f"status:{r.status}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def median_summary(summaries: Sequence[Mapping[str, Any]]) -> Summary:
    """Key by key median over rounds (keys of the first summary; non-numbers are skipped)."""
    if not summaries:
        return {}
    keys = [k for k, v in summaries[0].items() if v is None or isinstance(v, int | float)]
    return {key: median(s.get(key) for s in summaries) for key in keys}
