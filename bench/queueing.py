"""Pure per-class queueing statistics: client records joined with the engine's records.

Strategy: the load generator knows each request's class and when its first
token arrived; the mock engine knows when the request reached its queue and
when it got a slot (`arrival_s`, `start_s`, same monotonic clock). They are
joined by x-request-id. A request that never got a slot (or never a first
token) is not dropped from the percentiles: it counts as waiting forever
(`math.inf`), so a starved class reads "starved", not "fast".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.stats import Record
from bench.table import fmt_ms, format_table

STARVED = "starved"


def percentile_inf(values: Sequence[float], q: float) -> float | None:
    """Like `stats.percentile`, but an infinite neighbour makes the answer infinite."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = ordered[math.floor(rank)], ordered[math.ceil(rank)]
    if math.isinf(high):
        return math.inf
    return low + (high - low) * (rank - math.floor(rank))


def class_stats(
    records: Sequence[Record], engine_requests: Sequence[Mapping[str, Any]], labels: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per class, in `labels` order."""
    by_id = {e["x_request_id"]: e for e in engine_requests if e.get("x_request_id")}
    run_start = min((r.start_s for r in records), default=0.0)
    return [_one_class(label, records, by_id, run_start) for label in labels]


def _one_class(
    label: str,
    records: Sequence[Record],
    by_id: Mapping[str, Mapping[str, Any]],
    run_start: float,
) -> dict[str, Any]:
    mine = [r for r in records if r.label == label]
    seen = [by_id[r.request_id] for r in mine if r.request_id in by_id]
    waits = [_wait(e) for e in seen]
    starts = [float(e["start_s"]) - run_start for e in seen if e.get("start_s") is not None]
    ttfts = [math.inf if r.ttft_s is None else r.ttft_s for r in mine]
    emitted = sorted({str(e["resolved"]["priority"]) for e in seen if e.get("resolved")})
    return {
        "class": label,
        "sent": len(mine),
        "reached_engine": len(seen),
        "started": sum(1 for w in waits if not math.isinf(w)),
        "completed": sum(1 for r in mine if r.ok),
        "engine_priority": emitted,
        # when this class last got a slot, in seconds from the run's first request
        "last_start_s": max(starts, default=None),
        "wait_p50_s": _finite(percentile_inf(waits, 50)),
        "wait_p99_s": _finite(percentile_inf(waits, 99)),
        "ttft_p50_s": _finite(percentile_inf(ttfts, 50)),
        "ttft_p99_s": _finite(percentile_inf(ttfts, 99)),
        "ttft_p50_starved": _is_inf(percentile_inf(ttfts, 50)),
        "ttft_p99_starved": _is_inf(percentile_inf(ttfts, 99)),
        "wait_p50_starved": _is_inf(percentile_inf(waits, 50)),
        "wait_p99_starved": _is_inf(percentile_inf(waits, 99)),
    }


def _wait(engine_record: Mapping[str, Any]) -> float:
    start = engine_record.get("start_s")
    return math.inf if start is None else float(start) - float(engine_record["arrival_s"])


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: starved percentiles are None plus a `*_starved` flag."""
    return None if value is None or math.isinf(value) else value


def _is_inf(value: float | None) -> bool:
    return value is not None and math.isinf(value)


def _cell(row: Mapping[str, Any], key: str) -> str:
    if row.get(f"{key}_starved"):
        return STARVED
    value = row.get(f"{key}_s")
    return fmt_ms(value, 0) if value is not None else "-"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def priority_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """runs: {"backend", "policy", "classes": [class_stats rows]}."""
    headers = ["backend", "policy", "class", "engine prio", "sent", "started", "done"]
    headers += ["last start", "wait p50", "wait p99", "TTFT p50", "TTFT p99"]
    rows = []
    for run in runs:
        for row in run["classes"]:
            rows.append(
                [
                    run["backend"],
                    run["policy"],
                    row["class"],
                    ",".join(row["engine_priority"]) or "-",
                    str(row["sent"]),
                    str(row["started"]),
                    str(row["completed"]),
                    _seconds(row["last_start_s"]),
                    _cell(row, "wait_p50"),
                    _cell(row, "wait_p99"),
                    _cell(row, "ttft_p50"),
                    _cell(row, "ttft_p99"),
                ]
            )
    note = (
        "(times in ms; wait = engine queue wait; starved = that percentile never got a slot/token)"
    )
    return format_table(headers, rows) + "\n" + note
