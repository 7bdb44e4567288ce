"""Pure verdict of a soak run: does Pylon's memory stay flat across a long run?

Strategy: the soak takes one RSS sample after each window, as (seconds since
the start, bytes). The first windows include warm-up growth (imports, the
upstream pool, allocator arenas filling up), so the trend is a least-squares
line over the second half of the windows only, reported in MiB per hour and
as the growth it implies over that half. No clocks, no I/O: the soak command
hands in the samples and prints what comes back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.table import fmt_mib, fmt_num, format_table

MIB = 1 << 20
SECONDS_PER_HOUR = 3600.0
PEAK_LIMIT_BYTES = 150 * MIB
"""The target (issue 7): peak RSS under 256 concurrent streams <= 150 MiB."""
DEFAULT_MAX_GROWTH_MIB = 5.0
"""Growth over the second half that still reads as flat. A 10-minute soak's second
half is 5 minutes: 5 MiB there is 60 MiB an hour, which a day of traffic would turn
into a restart; a real leak under 12,800 events/s grows far faster than that."""


@dataclass(frozen=True)
class Sample:
    """Pylon's RSS after one window."""

    t_s: float
    """Seconds since the first window started."""
    rss_bytes: int
    """VmRSS summed over the process tree."""


@dataclass(frozen=True)
class SoakVerdict:
    first_rss_bytes: int
    """After the first window."""
    last_rss_bytes: int
    """After the last window."""
    peak_rss_bytes: int
    """The highest VmHWM of any window (or RSS sample, if higher)."""
    fitted_windows: int
    """Windows in the fit: the second half, at least two."""
    fitted_span_s: float
    """Time between the first and the last sample of the fit."""
    slope_bytes_per_s: float | None
    """Least-squares slope of RSS over the fitted windows; None with fewer than two."""
    growth_bytes: float | None
    """slope x fitted span: what the trend adds over the second half."""
    peak_within_limit: bool
    flat: bool | None
    """growth < the threshold; None when there is no slope (one window)."""

    @property
    def slope_mib_per_h(self) -> float | None:
        if self.slope_bytes_per_s is None:
            return None
        return self.slope_bytes_per_s * SECONDS_PER_HOUR / MIB


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of the least-squares line through (xs, ys); None for fewer than two
    distinct xs (no line is defined)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs for {len(ys)} ys")
    if len(set(xs)) < 2:
        return None
    x_mean, y_mean = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((x - x_mean) ** 2 for x in xs)
    sxy = math.fsum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True))
    return sxy / sxx


def second_half(samples: Sequence[Sample]) -> Sequence[Sample]:
    """The later half of the windows (the larger half when odd), at least two when there
    are two: enough for a line, and clear of the warm-up in a long run."""
    keep = max(math.ceil(len(samples) / 2), min(2, len(samples)))
    return samples[len(samples) - keep :]


def soak_verdict(
    samples: Sequence[Sample],
    *,
    window_peaks: Sequence[int | None] = (),
    max_growth_bytes: float = DEFAULT_MAX_GROWTH_MIB * MIB,
    peak_limit_bytes: int = PEAK_LIMIT_BYTES,
) -> SoakVerdict:
    if not samples:
        raise ValueError("a soak verdict needs at least one RSS sample")
    fitted = second_half(samples)
    xs = [s.t_s for s in fitted]
    slope = least_squares_slope(xs, [float(s.rss_bytes) for s in fitted])
    span = max(xs) - min(xs)
    growth = None if slope is None else slope * span
    peak = max([s.rss_bytes for s in samples] + [p for p in window_peaks if p is not None])
    return SoakVerdict(
        first_rss_bytes=samples[0].rss_bytes,
        last_rss_bytes=samples[-1].rss_bytes,
        peak_rss_bytes=peak,
        fitted_windows=len(fitted),
        fitted_span_s=span,
        slope_bytes_per_s=slope,
        growth_bytes=growth,
        peak_within_limit=peak <= peak_limit_bytes,
        flat=None if growth is None else growth < max_growth_bytes,
    )


def verdict_checks(
    verdict: SoakVerdict, *, max_growth_bytes: float, peak_limit_bytes: int = PEAK_LIMIT_BYTES
) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met?) rows, as `compare_report.targets_table` prints them."""
    growth = verdict.growth_bytes
    return [
        (
            f"peak RSS <= {fmt_mib(peak_limit_bytes)} MiB",
            f"{fmt_mib(verdict.peak_rss_bytes)} MiB",
            verdict.peak_within_limit,
        ),
        (
            f"growth over the second half < {fmt_mib(max_growth_bytes)} MiB",
            f"{_signed_mib(growth)} MiB over {verdict.fitted_span_s:.0f} s "
            f"({verdict.fitted_windows} windows; {_signed(verdict.slope_mib_per_h)} MiB/h)",
            verdict.flat,
        ),
    ]


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _signed_mib(value_bytes: float | None) -> str:
    return _signed(None if value_bytes is None else value_bytes / MIB)


def figures_table(
    verdict: SoakVerdict, *, idle: Mapping[str, int | None], last_pss_bytes: int | None
) -> str:
    rows = [
        ["RSS before the first window", fmt_mib(idle.get("idle_rss_bytes"))],
        ["RSS after the first window", fmt_mib(verdict.first_rss_bytes)],
        ["RSS after the last window", fmt_mib(verdict.last_rss_bytes)],
        ["peak RSS (highest window VmHWM)", fmt_mib(verdict.peak_rss_bytes)],
        ["slope over the second half (MiB/h)", _signed(verdict.slope_mib_per_h)],
        ["growth over the second half", _signed_mib(verdict.growth_bytes)],
        ["PSS before the first window", fmt_mib(idle.get("idle_pss_bytes"))],
        ["PSS after the last window", fmt_mib(last_pss_bytes)],
    ]
    note = "PSS: shared pages split between the processes mapping them"
    return format_table(["figure", "MiB"], rows) + f"\n({note})"


WINDOW_HEADERS = ["window", "end s", "ok", "err", "events", "lost", "Pylon CPU s"]
WINDOW_HEADERS += ["other CPU s", "RSS", "peak RSS", "PSS"]


def windows_table(windows: Sequence[Mapping[str, float | int | None]]) -> str:
    """One row per window: load done, Pylon's CPU, other work's CPU, memory."""
    rows = [
        [
            fmt_num(w.get("window"), 0),
            fmt_num(w.get("end_s"), 0),
            fmt_num(w.get("ok"), 0),
            fmt_num(w.get("errors"), 0),
            fmt_num(w.get("events"), 0),
            fmt_num(w.get("lost_events"), 0),
            fmt_num(w.get("proxy_cpu_s"), 1),
            fmt_num(w.get("other_cpu_s"), 1),
            fmt_mib(w.get("rss_bytes")),
            fmt_mib(w.get("proxy_peak_rss_bytes")),
            fmt_mib(w.get("pss_bytes")),
        ]
        for w in windows
    ]
    units = "RSS and PSS after the window, peak RSS (VmHWM) during it, in MiB, of the process tree"
    return format_table(WINDOW_HEADERS, rows) + f"\n({units})"


def totals(windows: Sequence[Mapping[str, float | int | None]]) -> dict[str, float]:
    """Sums over the windows, and the cores other work kept busy on average."""
    keys = ("requests", "ok", "errors", "events", "lost_events", "proxy_cpu_s", "other_cpu_s")
    sums = {key: math.fsum(float(w.get(key) or 0) for w in windows) for key in keys}
    # Per second of the interval the CPU times were taken over, not of the load's wall
    # time (the workers hand their records over after it).
    accounted = math.fsum(float(w.get("accounted_s") or 0) for w in windows)
    sums["accounted_s"] = accounted
    sums["other_busy_cores"] = sums["other_cpu_s"] / accounted if accounted else 0.0
    sums["pylon_busy_cores"] = sums["proxy_cpu_s"] / accounted if accounted else 0.0
    return sums


def heap_table(windows: Sequence[Mapping[str, Any]]) -> str:
    """Pylon's traced Python heap after each window, and the sites that grew since the first.

    RSS also counts pages the allocator keeps after their objects are gone;
    the traced heap counts only live blocks, so the two together tell a leak
    from allocator growth.
    """
    dumps: list[Mapping[str, Any]] = [w["python_heap"] for w in windows if "python_heap" in w]
    if not dumps:
        return ""
    rows = [[fmt_num(d["dump"], 0), fmt_mib(d["traced_bytes"])] for d in dumps]
    growth_kib = (dumps[-1]["traced_bytes"] - dumps[0]["traced_bytes"]) / 1024
    site_rows = [
        [g["site"], f"{g['size_diff_bytes'] / 1024:+.1f}", f"{g['count_diff']:+d}"]
        for g in dumps[-1]["growth_since_first"]
    ]
    return "\n".join(
        [
            format_table(["window", "traced heap MiB"], rows),
            f"(traced heap, first to last window: {growth_kib:+.1f} KiB; the sites that grew:)",
            format_table(["site", "KiB since window 1", "blocks"], site_rows),
        ]
    )
