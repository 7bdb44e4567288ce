"""The PNG plots of `compare`, `priority` and `soak` (drawn only when matplotlib is installed).

Each function hands a `draw(pyplot)` callback to `output.plot`, which skips
the file with a message when matplotlib is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.output import cdf, plot
from bench.soak_report import MIB, PEAK_LIMIT_BYTES, Sample, SoakVerdict, second_half
from bench.stats import Record, percentile
from bench.workloads import PriorityClass

CDF_TAIL_PERCENTILE = 99.9
"""Linear CDF axes stop here, so one outlier does not flatten the curves."""


def _ttfb_ms(records: Sequence[Record]) -> list[float]:
    return [r.ttfb_s * 1000 for r in records if r.ok and r.ttfb_s is not None]


def _gaps_ms(records: Sequence[Record]) -> list[float]:
    return [g * 1000 for r in records if r.ok for g in r.gaps_s]


def _cdf_drawer(
    samples: dict[str, list[Record]],
    values_of: Callable[[Sequence[Record]], list[float]],
    *,
    title: str,
    xlabel: str,
    log_x: bool,
) -> Callable[[Any], None]:
    def draw(pyplot: Any) -> None:
        tail = 0.0
        for name, records in samples.items():
            values = values_of(records)
            xs, ys = cdf(values)
            pyplot.plot(xs, ys, label=name)
            tail = max(tail, percentile(values, CDF_TAIL_PERCENTILE) or 0.0)
        if log_x:
            pyplot.xscale("log")
        elif tail > 0:
            pyplot.xlim(0, tail)
        pyplot.xlabel(xlabel)
        pyplot.ylabel("fraction")
        pyplot.title(title)
        pyplot.legend()
        pyplot.grid(True, which="both", alpha=0.3)

    return draw


def compare_plots(out: Path, workload: str, samples: dict[str, list[Record]]) -> None:
    """TTFB CDF per path (log scale); for streams also the inter-event gap CDF."""
    title = f"{workload}: TTFB by path, all rounds"
    ttfb = _cdf_drawer(samples, _ttfb_ms, title=title, xlabel="TTFB (ms)", log_x=True)
    plot(out / "ttfb_cdf.png", ttfb)
    if workload == "stream":
        title = f"{workload}: gap between SSE events by path, all rounds"
        gaps = _cdf_drawer(samples, _gaps_ms, title=title, xlabel="gap (ms)", log_x=False)
        plot(out / "gap_cdf.png", gaps)


def priority_plot(
    out: Path,
    *,
    backends: Sequence[str],
    classes: Sequence[PriorityClass],
    runs: Sequence[dict[str, Any]],
    cap_s: float,
) -> None:
    """p50 TTFT per class, one panel per backend, one bar per policy; starved bars hatched."""
    labels = [c.label for c in classes]

    def draw(pyplot: Any) -> None:
        figure = pyplot.gcf()
        for index, backend in enumerate(backends):
            axes = figure.add_subplot(1, len(backends), index + 1)
            mine = [r for r in runs if r["backend"] == backend]
            width = 0.8 / max(len(mine), 1)
            for offset, run in enumerate(mine):
                _policy_bars(axes, run, labels, offset=offset, width=width, cap_ms=cap_s * 1000)
            centres = [i + width * (len(mine) - 1) / 2 for i in range(len(labels))]
            axes.set_xticks(centres, labels)
            axes.set_title(backend)
            axes.set_ylabel("p50 TTFT (ms); hatched = starved")
            axes.legend()

    plot(out / "priority_ttft.png", draw, size=(5 * len(backends), 5))


def _policy_bars(
    axes: Any, run: dict[str, Any], labels: list[str], *, offset: int, width: float, cap_ms: float
) -> None:
    rows = {row["class"]: row for row in run["classes"]}
    starved = [bool(rows[label]["ttft_p50_starved"]) for label in labels]
    heights = [
        cap_ms if is_starved else (rows[label]["ttft_p50_s"] or 0.0) * 1000
        for label, is_starved in zip(labels, starved, strict=True)
    ]
    xs = [i + offset * width for i in range(len(labels))]
    bars = axes.bar(xs, heights, width, label=run["policy"])
    for bar, is_starved in zip(bars, starved, strict=True):
        if is_starved:
            bar.set_hatch("//")


def soak_plot(
    out: Path, samples: Sequence[Sample], *, windows: Sequence[dict[str, Any]], verdict: SoakVerdict
) -> None:
    """RSS after each window and VmHWM during it over time, the fitted trend, the target."""

    def draw(pyplot: Any) -> None:
        minutes = [s.t_s / 60 for s in samples]
        pyplot.plot(minutes, [s.rss_bytes / MIB for s in samples], "o-", label="RSS after window")
        peaks = [(w.get("proxy_peak_rss_bytes") or 0) / MIB for w in windows]
        pyplot.plot(minutes, peaks, "x--", label="peak RSS during window")
        fitted = second_half(samples)
        if verdict.slope_bytes_per_s is not None:
            # The least-squares line passes through the mean of the fitted points.
            t_mean = sum(s.t_s for s in fitted) / len(fitted)
            rss_mean = sum(s.rss_bytes for s in fitted) / len(fitted)
            slope_b = verdict.slope_bytes_per_s
            line = [(rss_mean + slope_b * (s.t_s - t_mean)) / MIB for s in fitted]
            slope = verdict.slope_mib_per_h or 0.0
            label = f"trend, second half: {slope:+.1f} MiB/h"
            pyplot.plot([s.t_s / 60 for s in fitted], line, "-", linewidth=2, label=label)
        # From 0 and with the target drawn: noise of a few hundred KiB must not look
        # like a trend, and the distance to the limit should show.
        limit = PEAK_LIMIT_BYTES / MIB
        pyplot.axhline(limit, color="red", linestyle=":", label=f"target: peak <= {limit:.0f} MiB")
        pyplot.ylim(0, max([limit, *peaks]) * 1.1)
        pyplot.xlabel("minutes since the first window started")
        pyplot.ylabel("MiB (Pylon process tree)")
        pyplot.title("soak: Pylon memory over the run")
        pyplot.legend()
        pyplot.grid(True, alpha=0.3)

    plot(out / "soak_rss.png", draw)
