"""One load run with the accounting around it: CPU, peak RSS and UDP drops from /proc.

Strategy: the snapshots are taken in `run_load`'s `on_start` hook (every
worker connected, nothing sent yet) and right after the last worker reports,
so handshakes and process start-up stay outside the numbers (`accounted_s` is the
time between the snapshots: a little longer than the load's wall time, since the
workers hand their records over after it). The proxy's
peak-RSS window is reset at the start, so each run reports its own peak.
"""

from __future__ import annotations

import time

from bench import stack
from bench.load import LoadSpec, run_load
from bench.procfs import (
    CpuTimes,
    cpu_seconds,
    cpu_times,
    machine_busy_seconds,
    peak_rss_bytes,
    reset_peak_rss,
    udp_drops,
    udp_rcvbuf_errors,
)
from bench.stats import Record, Summary, ratio, summarize


def measure(
    spec: LoadSpec, *, engine: stack.Service, proxy: stack.Service | None, label: str
) -> tuple[list[Record], Summary]:
    marks: dict[str, float] = {}
    proxy_mark: list[CpuTimes] = []

    def on_start() -> None:
        if proxy is not None:
            reset_peak_rss(proxy.pid)
            proxy_mark.append(cpu_times(proxy.pid))
        marks["engine"] = cpu_seconds(engine.pid)
        marks["machine"] = machine_busy_seconds()
        marks["accounted"] = time.monotonic()
        marks["udp_errors"] = udp_rcvbuf_errors()
        marks["proxy_drops"] = _drops(proxy)

    stack.engine_clear(engine.url)
    result = run_load(spec, label=label, on_start=on_start)
    summary = summarize(result.records, wall_s=result.wall_s)
    machine_cpu = machine_busy_seconds() - marks["machine"]
    accounted_s = time.monotonic() - marks["accounted"]
    proxy_cpu: float | None = None
    proxy_user: float | None = None
    proxy_system: float | None = None
    if proxy is not None:
        times = cpu_times(proxy.pid).since(proxy_mark[0])
        proxy_cpu, proxy_user, proxy_system = times.total, times.user, times.system
    engine_cpu = cpu_seconds(engine.pid) - marks["engine"]
    events = summary["events"] or None
    requests = len(result.records)
    udp_dropped = udp_rcvbuf_errors() - marks["udp_errors"]
    proxy_dropped = _drops(proxy) - marks["proxy_drops"]
    summary |= {
        "udp_dropped": udp_dropped,
        "proxy_udp_dropped": proxy_dropped if proxy is not None else None,
        "client_cpu_s": result.client_cpu_s,
        "engine_cpu_s": engine_cpu,
        "machine_cpu_s": machine_cpu,
        "accounted_s": accounted_s,
        "other_cpu_s": machine_cpu - result.client_cpu_s - engine_cpu - (proxy_cpu or 0.0),
        "proxy_cpu_s": proxy_cpu,
        "proxy_cpu_per_request_s": ratio(proxy_cpu, requests),
        "proxy_cpu_per_event_s": ratio(proxy_cpu, events),
        # User time is the proxy's own code (for Pylon, Python); system time is its
        # system calls, where a proxy that makes fewer of them saves.
        "proxy_user_cpu_per_request_s": ratio(proxy_user, requests),
        "proxy_system_cpu_per_request_s": ratio(proxy_system, requests),
        "proxy_peak_rss_bytes": None if proxy is None else peak_rss_bytes(proxy.pid),
    }
    return result.records, summary


def _drops(proxy: stack.Service | None) -> float:
    """Datagrams dropped at the proxy's UDP socket so far (0 for none: the direct path)."""
    return float((udp_drops(proxy.port) or 0) if proxy is not None else 0)
