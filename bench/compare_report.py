"""Pure comparison of the three paths: added latency, ratios, target checks, tables.

Strategy: every comparison is made within one round (the paths ran back to
back, so slow drift of the machine cancels) and the median over rounds is
reported. "Added" means the path's percentile minus the direct path's
percentile of the same metric in the same round. CPU and memory are the
proxy process's own, so they compare Pylon with Caddy only: the direct path
has no proxy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bench.stats import Summary, difference, median_summary, ratio
from bench.table import MISSING, fmt_mib, fmt_ms, fmt_num, fmt_ratio, fmt_us, format_table

DIRECT, PYLON, CANDIDATE, CADDY = "direct", "pylon", "candidate", "caddy"
PROXIES = (PYLON, CANDIDATE, CADDY)
ADDED = ("ttfb_p50_s", "ttfb_p99_s", "gap_p50_s", "gap_p99_s")
VS_DIRECT = ("throughput_rps", "ttfb_p50_s", "ttfb_p99_s", "gap_p99_s")
VS_CADDY = (
    *VS_DIRECT,
    "proxy_cpu_per_request_s",
    "proxy_user_cpu_per_request_s",
    "proxy_system_cpu_per_request_s",
    "proxy_cpu_per_event_s",
    "proxy_peak_rss_bytes",
)
MIB = 1 << 20


def round_comparison(by_path: Mapping[str, Mapping[str, float | int | None]]) -> Summary:
    """Flat keys: "added <metric> <path>" and "<metric> <a>/<b>"."""
    out: Summary = {}
    direct = by_path.get(DIRECT, {})
    for path in (p for p in PROXIES if p in by_path):
        for metric in ADDED:
            out[f"added {metric} {path}"] = difference(by_path[path][metric], direct.get(metric))
        for metric in VS_DIRECT:
            out[f"{metric} {path}/{DIRECT}"] = ratio(by_path[path][metric], direct.get(metric))
    for a, b in ((PYLON, CADDY), (CANDIDATE, CADDY), (CANDIDATE, PYLON)):
        if a in by_path and b in by_path:
            for metric in VS_CADDY:
                out[f"{metric} {a}/{b}"] = ratio(by_path[a][metric], by_path[b][metric])
    return out


def median_comparison(rounds: Sequence[Mapping[str, Mapping[str, float | int | None]]]) -> Summary:
    return median_summary([round_comparison(r) for r in rounds])


def target_checks(
    workload: str, medians: Mapping[str, Summary], comparison: Summary
) -> list[tuple[str, str, bool | None]]:
    """(target from issue 7, what was measured, met?) for this workload; None = not measured."""
    pylon = medians.get(PYLON, {})
    checks: list[tuple[str, str, bool | None]] = []
    if workload == "small":
        added = comparison.get(f"added ttfb_p50_s {PYLON}")
        checks.append(("added p50 TTFB vs direct <= 1 ms", f"{fmt_ms(added)} ms", _le(added, 1e-3)))
    if workload == "stream":
        lost, errors = pylon.get("lost_events"), pylon.get("errors")
        no_loss = None if lost is None else (lost == 0 and errors == 0)
        checks.append(
            ("no lost events", f"lost {fmt_num(lost)}, errors {fmt_num(errors)}", no_loss)
        )
        added = comparison.get(f"added gap_p99_s {PYLON}")
        checks.append(
            ("p99 added inter-token delay <= 5 ms", f"{fmt_ms(added)} ms", _le(added, 5e-3))
        )
        rss = pylon.get("proxy_peak_rss_bytes")
        checks.append(("peak RSS <= 150 MiB", f"{fmt_mib(rss)} MiB", _le(rss, 150 * MIB)))
    for metric, text in (
        ("proxy_cpu_per_request_s", "CPU per request <= Caddy"),
        ("proxy_cpu_per_event_s", "CPU per event <= Caddy"),
    ):
        value = comparison.get(f"{metric} {PYLON}/{CADDY}")
        if value is not None or metric == "proxy_cpu_per_request_s":
            checks.append((text, fmt_ratio(value), _le(value, 1.0)))
    return checks


def _le(value: float | int | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def paths_table(medians: Mapping[str, Summary]) -> str:
    headers = ["path", "ok", "err", "req/s", "TTFB p50", "TTFB p99", "gap p50", "gap p99"]
    headers += ["lost", "UDP drops", "proxy CPU/req", "user/sys", "CPU/event", "peak RSS"]
    headers += ["client CPU", "other CPU"]
    rows = []
    for path, m in medians.items():
        rows.append(
            [
                path,
                fmt_num(m.get("ok"), 0),
                fmt_num(m.get("errors"), 0),
                fmt_num(m.get("throughput_rps")),
                fmt_ms(m.get("ttfb_p50_s")),
                fmt_ms(m.get("ttfb_p99_s")),
                fmt_ms(m.get("gap_p50_s")),
                fmt_ms(m.get("gap_p99_s")),
                fmt_num(m.get("lost_events"), 0),
                _drops_cell(m),
                fmt_ms(m.get("proxy_cpu_per_request_s"), 3),
                _user_system_cell(m),
                fmt_us(m.get("proxy_cpu_per_event_s")),
                fmt_mib(m.get("proxy_peak_rss_bytes")),
                fmt_num(m.get("client_cpu_s"), 2),
                fmt_num(m.get("other_cpu_s"), 2),
            ]
        )
    units = (
        "times in ms, CPU/req in ms, CPU/event in us, RSS in MiB, CPU in s; medians over rounds;\n"
        " user/sys: CPU/req split into the proxy's own code and its system calls;\n"
        " UDP drops: datagrams lost to full socket buffers, at the proxy / machine-wide;\n"
        " other CPU: busy time of everything else on the machine during the run"
    )
    return format_table(headers, rows) + f"\n({units})"


def _user_system_cell(m: Summary) -> str:
    user, system = m.get("proxy_user_cpu_per_request_s"), m.get("proxy_system_cpu_per_request_s")
    if user is None or system is None:
        return MISSING
    return f"{fmt_ms(user, 3)}/{fmt_ms(system, 3)}"


def _drops_cell(m: Summary) -> str:
    at_proxy, everywhere = m.get("proxy_udp_dropped"), m.get("udp_dropped")
    if at_proxy is None:
        return fmt_num(everywhere, 0)
    return f"{fmt_num(at_proxy, 0)}/{fmt_num(everywhere, 0)}"


def ratios_table(comparison: Summary) -> str:
    pairs = [(PYLON, DIRECT), (PYLON, CADDY), (CADDY, DIRECT)]
    if any(key.endswith(f" {CANDIDATE}/{PYLON}") for key in comparison):
        pairs += [(CANDIDATE, DIRECT), (CANDIDATE, PYLON), (CANDIDATE, CADDY)]
    rows: list[list[str]] = []
    for metric in VS_CADDY:
        values = [comparison.get(f"{metric} {a}/{b}") for a, b in pairs]
        rows.append([metric, *(fmt_ratio(v) for v in values)])
    for metric in ADDED:
        cells = [
            fmt_ms(comparison.get(f"added {metric} {a}")) if b == DIRECT else "-" for a, b in pairs
        ]
        rows.append([f"added {metric} (ms)", *cells])
    headers = ["metric", *(f"{a}/{b}" for a, b in pairs)]
    return format_table(headers, rows) + "\n(added: path minus direct, in the x/direct columns)"


def targets_table(checks: Sequence[tuple[str, str, bool | None]]) -> str:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    rows = [[target, measured, verdict[ok]] for target, measured, ok in checks]
    return format_table(["target", "measured", "verdict"], rows)
