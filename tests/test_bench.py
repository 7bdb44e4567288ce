"""The bench machinery: pure helpers by table, then tiny real runs (no timing asserted).

The smoke tests start a real mock engine, Pylon and (when installed) Caddy as
subprocesses and push a handful of requests through each path, checking the
shape and counts of what the bench writes, never how fast anything was.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import compare_report, heap_probe, procfs, queueing, soak_report, stack
from bench.__main__ import main
from bench.caddy import caddyfile
from bench.compare import CompareOptions, run_compare
from bench.drivers import Target
from bench.experiments import instructions, quic_stacks
from bench.load import LoadSpec, run_load
from bench.output import build_flags, cdf, interpreter, maps_libpython
from bench.priority import PriorityOptions, run_priority
from bench.soak import SoakOptions
from bench.soak_report import MIB, Sample, least_squares_slope, second_half, soak_verdict
from bench.sse import StreamObserver
from bench.stats import Record, difference, median, median_summary, percentile, ratio, summarize
from bench.table import fmt_mib, fmt_ms, fmt_ratio, format_table
from bench.workloads import interleave, parse_classes, priority, small, stream, with_headers
from tests.harness import eventually, in_ci, process_alive, run


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([5.0], 0, 5.0),
        ([5.0], 99, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([0.0, 10.0], 99, 9.9),
        (list(map(float, range(101))), 99, 99.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    result = percentile(values, q)
    assert result == (None if expected is None else pytest.approx(expected))


def test_percentile_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@pytest.mark.parametrize(
    ("num", "den", "expected"),
    [(1.0, 2.0, 0.5), (None, 2.0, None), (1.0, None, None), (1.0, 0.0, None), (0.0, 4.0, 0.0)],
)
def test_ratio(num: float | None, den: float | None, expected: float | None) -> None:
    assert ratio(num, den) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], None), ([None, None], None), ([3, None, 1, 2], 2.0), ([1, 2], 1.5)],
)
def test_median_skips_missing(values: list[float | None], expected: float | None) -> None:
    assert median(values) == expected


def test_difference_and_median_summary() -> None:
    assert difference(3.0, 1.0) == 2.0
    assert difference(None, 1.0) is None
    rounds: list[dict[str, Any]] = [{"a": 1.0, "b": None, "c": "x"}, {"a": 3.0, "b": 2.0, "c": "y"}]
    assert median_summary(rounds) == {"a": 2.0, "b": 2.0}


def _record(
    label: str = "all", *, request_id: str = "r", status: int | None = 200, **fields: Any
) -> Record:
    return Record(label=label, request_id=request_id, start_s=0.0, status=status, **fields)


def test_summarize_counts_errors_and_lost_events() -> None:
    records = [
        _record(ttfb_s=0.01, total_s=0.1, events=4, expected_events=4, gaps_s=(0.02, 0.02, 0.04)),
        _record(ttfb_s=0.03, total_s=0.2, events=2, expected_events=4, gaps_s=(0.02,)),
        _record(status=None, error="timeout", expected_events=4),
        _record(status=503),
    ]
    summary = summarize(records, wall_s=2.0)
    assert summary["requests"] == 4
    assert summary["ok"] == 2
    assert summary["errors"] == 2
    assert summary["throughput_rps"] == 1.0
    assert summary["lost_events"] == 2 + 4
    assert summary["ttfb_p50_s"] == pytest.approx(0.02)
    assert summary["gap_p50_s"] == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("chunks", "events", "gaps"),
    [
        ([b"data: a\n\n"], 1, []),
        ([b"data: a\n\ndata: b\n\n"], 2, [0.0]),
        ([b"data: a\n", b"\ndata: b", b"\n\n"], 2, [1.0]),
        ([b": keep-alive\n\n", b"data: a\n\n"], 1, []),
        ([b"event: x\ndata: {}\n\n", b"data: [DONE]\n\n"], 2, [1.0]),
        ([b'{"plain": "json"}'], 0, []),
    ],
)
def test_stream_observer(chunks: list[bytes], events: int, gaps: list[float]) -> None:
    observer = StreamObserver(start_s=10.0)
    for index, chunk in enumerate(chunks):
        observer.feed(chunk, now=11.0 + index)
    assert observer.events == events
    assert observer.gaps_s == pytest.approx(gaps)
    assert observer.ttfb_s == 1.0
    assert observer.bytes == sum(map(len, chunks))


def test_interleave_honours_shares_and_spreads_classes() -> None:
    picks = interleave([("a", 0.5), ("b", 0.25), ("c", 0.25)], 100)
    assert (picks.count("a"), picks.count("b"), picks.count("c")) == (50, 25, 25)
    assert all(picks[i : i + 4].count("a") == 2 for i in range(0, 100, 4))


@pytest.mark.parametrize("text", ["", "0", "x:1", "0:1,0:2", "0:0"])
def test_parse_classes_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_classes(text)


def test_priority_pattern_sets_x_priority_only_for_configured_classes() -> None:
    classes = parse_classes("0:0.5,none:0.5")
    assert [(c.label, c.priority) for c in classes] == [("p0", 0), ("unconfigured", None)]
    pattern = with_headers(priority(classes, tokens=3), [("authorization", "Bearer t")])
    by_label = {spec.label: dict(spec.headers) for spec in pattern}
    assert by_label["p0"]["x-priority"] == "0"
    assert "x-priority" not in by_label["unconfigured"]
    assert all(spec.expected_events == 5 for spec in pattern)
    assert stream(tokens=7)[0].expected_events == 9
    assert small()[0].expected_events is None


def test_format_table_aligns_columns() -> None:
    text = format_table(["path", "req/s"], [["direct", "10.0"], ["pylon", "5.25"]])
    assert text.splitlines() == [
        "path    req/s",
        "------  -----",
        "direct   10.0",
        "pylon    5.25",
    ]
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["only one"]])


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        (fmt_ms(0.0012), "1.20"),
        (fmt_ms(None), "-"),
        (fmt_ratio(1.5), "1.50x"),
        (fmt_mib(3 << 20), "3.0"),
    ],
)
def test_formatters(cell: str, expected: str) -> None:
    assert cell == expected


STAT = "4242 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0 100 0 0"


def test_procfs_parsers() -> None:
    assert procfs.parse_stat_user_system_ticks(STAT) == (250, 50)
    status = "Name:\tpylon\nVmPeak:\t  9000 kB\nVmHWM:\t  1234 kB\nVmRSS:\t  1000 kB\n"
    assert procfs.parse_status_kib(status, "VmHWM") == 1234
    assert procfs.parse_status_kib(status, "VmSwap") is None
    proc_stat = "cpu  100 5 50 9000 40 3 2 1 0 0\ncpu0 50 2 25 4500 20 1 1 0 0 0\n"
    assert procfs.parse_busy_ticks(proc_stat) == 100 + 5 + 50 + 3 + 2 + 1
    udp = (
        "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
        "  timeout inode ref pointer drops\n"
        "  1: 0100007F:1F90 00000000:0000 07 00000000:00000000 00:00000000 00000000"
        "     0        0 3027 2 0000000037e98a1f 332\n"
    )
    assert procfs.parse_udp_drops(udp, 8080) == 332
    assert procfs.parse_udp_drops(udp, 8081) is None
    second_worker = udp.splitlines()[1].replace("  1:", "  2:").replace(" 332", " 8")
    assert procfs.parse_udp_drops(udp + second_worker + "\n", 8080) == 340
    assert procfs.parse_stat_ppid(STAT) == 1
    snmp = "Udp: InDatagrams NoPorts InErrors RcvbufErrors\nUdp: 10 0 7 7\n"
    assert procfs.parse_rcvbuf_errors(snmp) == 7


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("Name:\tpylon\nVmHWM:\t  1234 kB\nVmRSS:\t  1000 kB\nRssAnon:\t 600 kB\n", 1000),
        ("VmRSS:\t       0 kB\n", 0),
        ("Name:\tkthreadd\nState:\tS (sleeping)\n", None),  # kernel threads have no VmRSS
        ("RssAnon:\t 600 kB\nRssFile:\t 400 kB\n", None),  # not VmRSS
        ("", None),
    ],
)
def test_vmrss_parser(status: str, expected: int | None) -> None:
    assert procfs.parse_status_kib(status, "VmRSS") == expected


SMAPS_ROLLUP = (
    "55d0c0a00000-7ffd2b5fe000 ---p 00000000 00:00 0                          [rollup]\n"
    "Rss:               59476 kB\nPss:               39605 kB\nPss_Anon:          37204 kB\n"
)


def test_pss_parser_reads_smaps_rollup() -> None:
    assert procfs.parse_status_kib(SMAPS_ROLLUP, "Pss") == 39605
    assert procfs.parse_status_kib(SMAPS_ROLLUP, "Rss") == 59476


def test_cpu_times_split_user_from_system_time() -> None:
    before = procfs.cpu_times(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # user time only: no system call in the loop body
        sum(range(1000))
    spent = procfs.cpu_times(os.getpid()).since(before)
    assert spent.user >= 0.2
    assert spent.system < spent.user
    assert spent.total == pytest.approx(spent.user + spent.system)


def test_user_system_cell_needs_both_parts() -> None:
    split = {"proxy_user_cpu_per_request_s": 0.0005, "proxy_system_cpu_per_request_s": 0.0001}
    assert "0.500/0.100" in compare_report.paths_table({"pylon": split})
    alone = {"proxy_user_cpu_per_request_s": 0.0005}
    assert "0.500/" not in compare_report.paths_table({"pylon": alone})


@pytest.mark.parametrize(
    ("config_args", "expected"),
    [
        ("", []),
        (
            "'--prefix=/usr/local' '--enable-optimizations' '--enable-shared' '--with-lto'",
            ["--enable-optimizations", "--with-lto"],
        ),
        ("'--enable-shared' '--prefix=/root/.pyenv/versions/3.11.7'", []),
        ("--with-lto=full --enable-optimizations", ["--enable-optimizations", "--with-lto"]),
        ("'--with-ltofoo' '--enable-optimizations-x'", []),
    ],
    ids=["none", "docker-official", "pyenv", "unquoted", "lookalikes"],
)
def test_build_flags_read_from_configure_args(config_args: str, expected: list[str]) -> None:
    assert build_flags(config_args) == expected


def test_maps_libpython_reads_the_mapped_files() -> None:
    static = (
        "55d0c0000000-55d0c0400000 r-xp 00000000 fe:01 1234 /usr/bin/python3.11\n"
        "7f0000000000-7f0000100000 r-xp 00000000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n"
    )
    shared = static + (
        "7f1000000000-7f1000400000 r-xp 00000000 fe:01 77 "
        "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0\n"
    )
    assert not maps_libpython(static)
    assert maps_libpython(shared)
    assert not maps_libpython("7f00-7f01 rw-p 00000000 00:00 0\n")  # anonymous


@contextlib.contextmanager
def _python_behind_a_shell(code: str) -> Iterator[int]:
    """The pid of a shell running `python -c code` as its child; both end on exit.
    Two commands, so the shell stays the parent instead of exec-ing Python."""
    launcher = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{code}"; exit 0'])
    try:
        yield launcher.pid
    finally:
        subprocess.run(["pkill", "-P", str(launcher.pid)], check=False)
        launcher.wait(timeout=10)


def test_interpreter_of_a_process_behind_a_launcher() -> None:
    with _python_behind_a_shell("import time; time.sleep(30)") as launcher:
        # Until the shell has started its child.
        run(eventually(lambda: interpreter(launcher) is not None, within_s=5.0))
        found = interpreter(launcher)
        assert found is not None
        assert found["executable"] == os.path.realpath(sys.executable)
        assert found["version"] == sys.version.split()[0]
        # The same executable as this process, so linked the same way.
        own_maps = Path(f"/proc/{os.getpid()}/maps").read_text()
        assert found["shared_libpython"] == maps_libpython(own_maps)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", {1}), ("0,2", {0, 2}), ("2-3,6", {2, 3, 6}), (" 0 - 1 ", {0, 1})],
)
def test_parse_cpu_list(text: str, expected: set[int]) -> None:
    assert procfs.parse_cpu_list(text) == expected


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,2"])
def test_parse_cpu_list_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        procfs.parse_cpu_list(text)


def test_pin_tree_pins_every_thread_of_every_process_below() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    target = frozenset(allowed[-1:])
    # A shell with a Python child that runs a second thread: two processes, three threads.
    child = (
        "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
        "time.sleep(30)"
    )
    with _python_behind_a_shell(child) as launcher:
        run(eventually(lambda: len(procfs.thread_affinities(launcher)) >= 3, within_s=5.0))
        assert procfs.pin_tree(launcher, target) >= 3
        affinities = procfs.thread_affinities(launcher)
        assert len(affinities) >= 3
        assert all(cpus == target for cpus in affinities)
    assert sorted(os.sched_getaffinity(0)) == allowed  # this process was left alone


def test_process_tree_and_its_cpu_include_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = procfs.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        assert procfs.cpu_seconds(os.getpid()) >= procfs.cpu_seconds(child.pid)
        assert procfs.process_tree(child.pid) == [child.pid]
        own = procfs.parse_status_kib(Path("/proc/self/status").read_text(), "VmRSS")
        child_rss = procfs.rss_bytes(child.pid)
        assert own is not None and child_rss is not None and child_rss > 0
        assert (procfs.rss_bytes(os.getpid()) or 0) >= child_rss + own * 1024 // 2
        assert 0 < (procfs.pss_bytes(child.pid) or 0) <= child_rss
    finally:
        child.kill()
        child.wait()


# Soak samples: window ends seconds to minutes apart, RSS of tens to hundreds of MiB.
window_steps = st.lists(st.floats(1.0, 120.0), min_size=2, max_size=40)
rss_values = st.integers(10 * MIB, 1000 * MIB)
slopes = st.floats(-100_000.0, 100_000.0)
"""Bytes per second: +-360 MiB an hour, far beyond anything a soak should see."""


def _times(steps: list[float]) -> list[float]:
    return [sum(steps[: i + 1]) for i in range(len(steps))]


@given(steps=window_steps, rss=rss_values)
def test_slope_of_a_constant_series_is_zero(steps: list[float], rss: int) -> None:
    times = _times(steps)
    assert least_squares_slope(times, [float(rss)] * len(times)) == pytest.approx(0.0, abs=1e-9)


@given(steps=window_steps, start=rss_values, slope=slopes)
def test_slope_of_a_linear_series_is_recovered(
    steps: list[float], start: int, slope: float
) -> None:
    times = _times(steps)
    fitted = least_squares_slope(times, [start + slope * t for t in times])
    assert fitted == pytest.approx(slope, rel=1e-9, abs=1e-4)


@given(data=st.data(), steps=window_steps, shift=st.integers(-10 * MIB, 10 * MIB))
def test_slope_ignores_a_constant_offset(
    data: st.DataObject, steps: list[float], shift: int
) -> None:
    times = _times(steps)
    rss = data.draw(st.lists(rss_values, min_size=len(times), max_size=len(times)))
    plain = least_squares_slope(times, [float(r) for r in rss])
    shifted = least_squares_slope(times, [float(r + shift) for r in rss])
    assert plain is not None and shifted == pytest.approx(plain, rel=1e-9, abs=1e-4)


@pytest.mark.parametrize(
    ("xs", "ys"), [([], []), ([1.0], [5.0]), ([2.0, 2.0, 2.0], [1.0, 2.0, 3.0])]
)
def test_slope_needs_two_distinct_times(xs: list[float], ys: list[float]) -> None:
    assert least_squares_slope(xs, ys) is None


def test_slope_rejects_unpaired_values() -> None:
    with pytest.raises(ValueError):
        least_squares_slope([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    ("windows", "fitted"), [(1, [1]), (2, [1, 2]), (3, [2, 3]), (4, [3, 4]), (5, [3, 4, 5])]
)
def test_second_half_keeps_the_later_windows(windows: int, fitted: list[int]) -> None:
    samples = [Sample(float(i), i) for i in range(1, windows + 1)]
    assert [s.rss_bytes for s in second_half(samples)] == fitted
    assert len(second_half(samples * 10)) == windows * 5


@given(data=st.data(), warmup=st.lists(rss_values, min_size=1, max_size=20), rss=rss_values)
def test_warmup_growth_does_not_count_against_flatness(
    data: st.DataObject, warmup: list[int], rss: int
) -> None:
    """A run that grows or jumps in its first half, then holds, is flat whatever the
    warm-up did (the held part is at least as many windows as the warm-up)."""
    held = data.draw(st.lists(st.floats(1.0, 120.0), min_size=max(len(warmup), 2), max_size=40))
    times = _times([30.0] * len(warmup) + held)
    values = [*warmup, *([rss] * len(held))]
    verdict = soak_verdict([Sample(t, r) for t, r in zip(times, values, strict=True)])
    assert verdict.slope_bytes_per_s == pytest.approx(0.0, abs=1e-6)
    assert verdict.flat is True
    assert verdict.peak_rss_bytes == max(values)


def test_soak_verdict_reports_growth_peak_and_figures() -> None:
    leaking = [Sample(60.0 * i, 80 * MIB + i * MIB) for i in range(1, 11)]  # 1 MiB a minute
    verdict = soak_verdict(leaking, window_peaks=[None, 160 * MIB], max_growth_bytes=5 * MIB)
    assert verdict.slope_mib_per_h == pytest.approx(60.0)
    assert verdict.fitted_windows == 5 and verdict.fitted_span_s == 240.0
    assert verdict.growth_bytes == pytest.approx(4 * MIB)
    assert verdict.flat is True
    assert verdict.peak_rss_bytes == 160 * MIB and verdict.peak_within_limit is False
    assert (verdict.first_rss_bytes, verdict.last_rss_bytes) == (81 * MIB, 90 * MIB)
    stricter = soak_verdict(leaking, max_growth_bytes=3 * MIB)
    assert stricter.flat is False and stricter.peak_within_limit is True
    single = soak_verdict(leaking[:1])
    assert single.slope_bytes_per_s is None and single.flat is None
    checks = soak_report.verdict_checks(verdict, max_growth_bytes=5 * MIB)
    assert [ok for _, _, ok in checks] == [False, True]
    assert "+60.0 MiB/h" in checks[1][1]
    with pytest.raises(ValueError):
        soak_verdict([])


def test_cdf_is_monotonic() -> None:
    xs, ys = cdf([3.0, 1.0, 2.0], points=5)
    assert xs == sorted(xs) and xs[0] == 1.0 and xs[-1] == 3.0
    assert ys[0] == 0.0 and ys[-1] == 1.0
    assert cdf([]) == ([], [])


def _paths(direct: float, pylon: float, caddy: float) -> dict[str, dict[str, float | None]]:
    def one(ttfb: float, cpu: float | None) -> dict[str, float | None]:
        metrics: dict[str, float | None] = dict.fromkeys(compare_report.VS_CADDY, None)
        metrics |= dict.fromkeys(compare_report.ADDED, None)
        return metrics | {"ttfb_p50_s": ttfb, "throughput_rps": 1 / ttfb, "proxy_cpu_s": cpu}

    return {"direct": one(direct, None), "pylon": one(pylon, 2.0), "caddy": one(caddy, 1.0)}


def test_comparisons_are_per_round_medians() -> None:
    rounds = [_paths(0.001, 0.003, 0.002), _paths(0.002, 0.005, 0.003)]
    comparison = compare_report.median_comparison(rounds)
    assert comparison["added ttfb_p50_s pylon"] == pytest.approx(0.0025)
    assert comparison["ttfb_p50_s pylon/direct"] == pytest.approx((3 + 2.5) / 2)
    assert comparison["ttfb_p50_s pylon/caddy"] == pytest.approx((1.5 + 5 / 3) / 2)
    checks = compare_report.target_checks("small", {}, comparison)
    assert checks[0][0].startswith("added p50 TTFB") and checks[0][2] is False
    assert "pylon/direct" in compare_report.ratios_table(comparison)


def test_class_stats_counts_never_started_as_starved() -> None:
    records = [
        _record("p0", request_id="a", ttft_s=0.5),
        _record("p0", request_id="b", ttft_s=1.5),
        _record("unconfigured", request_id="c", status=None, error="timeout"),
    ]
    engine = [
        {"x_request_id": "a", "arrival_s": 1.0, "start_s": 1.25, "resolved": {"priority": 1000}},
        {"x_request_id": "b", "arrival_s": 1.0, "start_s": 2.0, "resolved": {"priority": 1000}},
        {"x_request_id": "c", "arrival_s": 1.0, "start_s": None, "resolved": {"priority": 0}},
    ]
    p0, unconfigured = queueing.class_stats(records, engine, ["p0", "unconfigured"])
    assert (p0["sent"], p0["started"], p0["engine_priority"]) == (2, 2, ["1000"])
    assert p0["wait_p50_s"] == pytest.approx(0.625)
    assert p0["ttft_p50_s"] == pytest.approx(1.0)
    assert p0["last_start_s"] == pytest.approx(2.0)
    assert unconfigured["started"] == 0 and unconfigured["last_start_s"] is None
    assert unconfigured["ttft_p50_s"] is None and unconfigured["ttft_p50_starved"]
    run = {"backend": "dynamo", "policy": "ceiling=1000", "classes": [p0, unconfigured]}
    assert queueing.STARVED in queueing.priority_table([run])
    assert queueing.percentile_inf([1.0, math.inf], 50) == math.inf


def _require_caddy() -> str:
    binary = stack.caddy_binary()
    if binary is None:
        if in_ci():
            pytest.fail("caddy is required in CI (apt-get install -y caddy)")
        pytest.skip("caddy not installed")
    return binary


def _adapted(binary: str, text: str, directory: Path) -> dict[str, Any]:
    """Caddy's own JSON for a Caddyfile: `caddy adapt` fails on one it rejects."""
    (directory / "Caddyfile").write_text(text)
    adapted = subprocess.run(
        [binary, "adapt", "--config", str(directory / "Caddyfile"), "--adapter", "caddyfile"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    config: dict[str, Any] = json.loads(adapted.stdout)
    return config


def test_generated_caddyfile_validates(tmp_path: Path) -> None:
    binary = _require_caddy()
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    text = caddyfile(port=4443, upstream="127.0.0.1:8000", cert=cert, key=key)
    assert "protocols h1 h2 h3" in text and "flush_interval -1" in text and "admin off" in text
    config = _adapted(binary, text, tmp_path)
    server = config["apps"]["http"]["servers"]["srv0"]
    assert server["protocols"] == ["h1", "h2", "h3"]
    assert server["listen"] == ["127.0.0.1:4443"]
    assert "logs" in server  # an access line per request, as Pylon writes
    assert config["logging"]["logs"]["log0"]["encoder"]["format"] == "json"

    quiet = caddyfile(port=4443, upstream="127.0.0.1:8000", cert=cert, key=key, access_log=False)
    assert "logs" not in _adapted(binary, quiet, tmp_path)["apps"]["http"]["servers"]["srv0"]


@pytest.mark.e2e
def test_load_records_a_refused_connection_as_an_error() -> None:
    spec = LoadSpec(
        target=Target("h1", stack.HOST, stack.free_port()),
        pattern=small(),
        requests=3,
        concurrency=1,
        workers=1,
        duration_s=10.0,
        drain_s=5.0,
    )
    result = run_load(spec, label="refused")
    assert sorted(r.request_id for r in result.records) == ["bench-0", "bench-1", "bench-2"]
    assert all(r.error == "ConnectError" and r.status is None for r in result.records)
    assert summarize(result.records, wall_s=result.wall_s)["errors"] == 3


@pytest.mark.e2e
def test_compare_smoke_writes_json_for_every_path(tmp_path: Path) -> None:
    _require_caddy()
    allowed = os.sched_getaffinity(0)
    # The proxies on a CPU of their own where there are two: exercised, not timed.
    pinned = frozenset(sorted(allowed)[-1:]) if len(allowed) > 1 else frozenset()
    options = CompareOptions(
        workload="stream",
        rounds=1,
        requests=4,
        concurrency=2,
        tokens=3,
        token_delay_ms=1.0,
        workers=1,
        warmup=1,
        duration_s=20.0,
        candidate_args=("--log-level", "warning"),
        proxy_cpus=pinned,
        out_root=tmp_path,
    )
    result = run_compare(options)
    assert os.sched_getaffinity(0) == allowed  # the bench gave this process its CPUs back
    written = json.loads(next(tmp_path.glob("*-compare-stream/compare.json")).read_text())
    assert written["options"]["proxy_cpus"] == sorted(options.proxy_cpus)
    assert written["medians"].keys() == {"direct", "pylon", "candidate", "caddy"}
    interpreters = written["machine"]["interpreters"]
    assert interpreters.keys() == {"pylon", "candidate"}
    assert interpreters["pylon"]["version"] == sys.version.split()[0]
    for path, summary in written["medians"].items():
        assert summary["requests"] == 4, path
        assert summary["ok"] == 4, written["rounds"][0]["errors"]
        assert summary["events"] == 4 * 5
        assert summary["lost_events"] == 0
    assert written["medians"]["pylon"]["proxy_cpu_s"] is not None
    assert written["medians"]["direct"]["proxy_cpu_s"] is None
    pylon = written["medians"]["pylon"]
    assert pylon["proxy_user_cpu_per_request_s"] + pylon[
        "proxy_system_cpu_per_request_s"
    ] == pytest.approx(pylon["proxy_cpu_per_request_s"])
    assert "proxy_user_cpu_per_request_s pylon/caddy" in written["comparison"]
    assert "ttfb_p50_s pylon/caddy" in written["comparison"]
    assert "proxy_cpu_per_event_s candidate/pylon" in written["comparison"]
    assert result["targets"]
    caddy_log = next(tmp_path.glob("*-compare-stream/caddy.log")).read_text()
    assert caddy_log.count('"logger":"http.log.access') >= 4


@pytest.mark.e2e
def test_priority_smoke_joins_engine_records(tmp_path: Path) -> None:
    options = PriorityOptions(
        backends=("dynamo",),
        ceilings=(1000,),
        classes=parse_classes("0:0.5,none:0.5"),
        slots=2,
        tokens=2,
        token_delay_ms=5.0,
        duration_s=0.5,
        drain_s=5.0,
        workers=1,
        out_root=tmp_path,
    )
    result = run_priority(options)
    (run,) = result["runs"]
    by_class = {row["class"]: row for row in run["classes"]}
    assert sum(row["sent"] for row in by_class.values()) == math.ceil(options.rate_rps * 0.5)
    for row in by_class.values():
        assert row["reached_engine"] == row["sent"]
        assert row["completed"] == row["sent"]
    assert by_class["p0"]["engine_priority"] == ["1000"]
    assert by_class["unconfigured"]["engine_priority"] == ["0"]
    assert (next(tmp_path.glob("*-priority")) / "priority.json").is_file()


@pytest.mark.e2e
def test_soak_smoke_writes_windows_and_figures(tmp_path: Path) -> None:
    argv = ["soak", "--duration-s", "4", "--window-s", "2", "--concurrency", "2"]
    argv += ["--tokens", "3", "--token-delay-ms", "50", "--workers", "1", "--out", str(tmp_path)]
    argv += ["--pylon-arg=--workers", "--pylon-arg=2"]
    assert main(argv) == 0
    written = json.loads(next(tmp_path.glob("*-soak/soak.json")).read_text())
    assert written["partial"] is False
    assert [w["window"] for w in written["windows"]] == [1, 2]
    for window in written["windows"]:
        assert window["ok"] > 0 and window["errors"] == 0 and window["lost_events"] == 0
        assert window["events"] == window["ok"] * 5
        assert window["rss_bytes"] > 0 and window["proxy_peak_rss_bytes"] > 0
        assert 0 < window["pss_bytes"] <= window["rss_bytes"]
        assert window["proxy_cpu_s"] is not None
    verdict = written["verdict"]
    assert verdict["first_rss_bytes"] == written["windows"][0]["rss_bytes"]
    assert verdict["last_rss_bytes"] == written["windows"][1]["rss_bytes"]
    assert verdict["fitted_windows"] == 2 and verdict["slope_mib_per_h"] is not None
    assert [type(t["met"]) for t in written["targets"]] == [bool, bool]  # figures, not asserted
    assert written["options"]["pylon_args"] == ["--workers", "2"]
    assert len(written["windows"][0]["pids"]) == 3  # the supervisor and its two workers
    assert written["machine"]["background_busy_cores"] is not None


@pytest.mark.e2e
def test_a_terminated_bench_stops_every_process_it_started(tmp_path: Path) -> None:
    # `kill` and `timeout` send SIGTERM: the engine and Pylon must not outlive the bench.
    argv = ["soak", "--duration-s", "120", "--window-s", "60", "--concurrency", "2"]
    argv += ["--tokens", "3", "--token-delay-ms", "50", "--workers", "1", "--out", str(tmp_path)]
    progress = tmp_path / "progress.log"
    with progress.open("wb") as stderr:
        bench = subprocess.Popen(
            [sys.executable, "-m", "bench", *argv], stdout=subprocess.DEVNULL, stderr=stderr
        )
    started: list[int] = []
    try:

        def window_started_or_bench_gone() -> bool:
            return "window 1/" in progress.read_text() or bench.poll() is not None

        assert run(eventually(window_started_or_bench_gone, within_s=60.0)), "no window in 60 s"
        assert bench.poll() is None, progress.read_text()
        started = procfs.process_tree(bench.pid)[1:]
        assert len(started) >= 2  # at least the engine and Pylon
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 130
        assert "interrupted" in progress.read_text()
        # multiprocessing's resource tracker leaves a moment after the bench; an
        # orphaned engine or Pylon would still be running long after that.
        run(eventually(lambda: not any(map(process_alive, started)), within_s=10.0))
        assert [pid for pid in started if process_alive(pid)] == []
    finally:
        bench.kill()
        bench.wait()
        for pid in started:  # what a failed run left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("filename", "site"),
    [
        (
            "/v/lib/python3.11/site-packages/aioquic/quic/connection.py",
            "aioquic/quic/connection.py:7",
        ),
        ("/usr/lib/python3.11/asyncio/events.py", "python3.11/asyncio/events.py:7"),
        ("relative/mod.py", "relative/mod.py:7"),
    ],
)
def test_heap_site_names_the_package_not_the_install(filename: str, site: str) -> None:
    assert heap_probe.short_site(filename, 7) == site


def test_heap_probe_dump_reports_live_growth_at_its_line(tmp_path: Path) -> None:
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start(1)
    try:
        probe = heap_probe.HeapProbe(tmp_path)
        first = json.loads(probe.dump().read_text())
        kept = [bytearray(512) for _ in range(400)]  # about 200 KiB kept alive
        allocation_line = sys._getframe().f_lineno - 1
        second = json.loads(probe.dump().read_text())
    finally:
        if not was_tracing:
            tracemalloc.stop()
    assert [first["dump"], second["dump"]] == [1, 2]
    assert first["growth_since_first"] == []
    assert second["traced_bytes"] - first["traced_bytes"] >= 400 * 512
    top = second["growth_since_first"][0]
    assert top["site"].endswith(f"test_bench.py:{allocation_line}")
    assert top["count_diff"] >= 400 and top["size_diff_bytes"] >= 400 * 512
    assert all(row["size_diff_bytes"] > 0 for row in second["growth_since_first"])
    assert len(kept) == 400


@pytest.mark.parametrize(
    "options",
    [
        {"pylon_args": ("--workers=2",)},
        {"pylon_args": ("--workers", "2")},
        {"pylon_command": ("python", "-m", "pylon.cli")},
    ],
)
def test_soak_python_heap_refuses_what_it_cannot_trace(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="--python-heap"):
        SoakOptions(python_heap=True, **options)
    SoakOptions(python_heap=False, **options)  # fine without the probe


@pytest.mark.e2e
def test_soak_smoke_with_python_heap_records_the_traced_heap(tmp_path: Path) -> None:
    argv = ["soak", "--duration-s", "4", "--window-s", "2", "--concurrency", "2", "--python-heap"]
    argv += ["--tokens", "3", "--token-delay-ms", "50", "--workers", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    written = json.loads(next(tmp_path.glob("*-soak/soak.json")).read_text())
    dumps = [w["python_heap"] for w in written["windows"]]
    assert [d["dump"] for d in dumps] == [1, 2]
    assert all(d["traced_bytes"] > MIB for d in dumps)  # Pylon's imports alone are more
    assert dumps[0]["growth_since_first"] == []
    assert "traced heap MiB" in soak_report.heap_table(written["windows"])


@pytest.mark.e2e
@pytest.mark.parametrize("h3", [False, True])
def test_quic_stacks_smoke_answers_every_request(h3: bool) -> None:
    runs = quic_stacks.run_rounds(("aioquic",), rounds=1, requests=20, concurrency=3, h3=h3)
    assert [(run.stack, run.requests) for run in runs] == [("aioquic", 20)]
    assert runs[0].server_cpu_s >= 0 and runs[0].wall_s > 0


def test_quic_stacks_report_gives_medians_and_their_ratio() -> None:
    runs = [quic_stacks.StackRun("aioquic", 100, cpu, 1.0) for cpu in (0.050, 0.040, 0.060)] + [
        quic_stacks.StackRun("aiopquic", 100, cpu, 1.0) for cpu in (0.010, 0.030, 0.020)
    ]
    assert quic_stacks.report(runs).splitlines() == [
        "server CPU per request, median of 3 rounds:",
        "  aioquic     500.0 us",
        "  aiopquic    200.0 us",
        "  aiopquic/aioquic 0.40x",
    ]


def _require_valgrind() -> None:
    if instructions.valgrind_binary() is None:
        if in_ci():
            pytest.fail("valgrind is required in CI (apt-get install -y valgrind)")
        pytest.skip("valgrind not installed")


def test_instructions_counts_only_the_measured_requests_under_callgrind() -> None:
    _require_valgrind()
    count = instructions.count_once("pylon", instructions.PYLON_COMMAND, requests=3, warmup=2)
    assert count.requests == 3
    # A small request is a few million instructions (Pylon's start-up, uncounted, is
    # billions); a dump with instrumentation left off would hold none.
    assert 2e5 < count.per_request < 5e7


def test_instructions_report_gives_medians_spread_and_ratio() -> None:
    counts = [instructions.Count("pylon", 100, n) for n in (200_000_000, 210_000_000)] + [
        instructions.Count("candidate", 100, n) for n in (190_000_000, 180_000_000)
    ]
    assert instructions.report(counts).splitlines() == [
        "Pylon's user-space instructions per small request (callgrind), one at a time:",
        "  pylon      median   2.050 M  (rounds 2.000, 2.100; spread 4.9%)",
        "  candidate  median   1.850 M  (rounds 1.900, 1.800; spread 5.4%)",
        "  candidate/pylon 0.902x",
    ]


def test_instructions_reads_the_newest_dump(tmp_path: Path) -> None:
    older, newer = tmp_path / "callgrind-pylon.out.1", tmp_path / "callgrind-pylon.out.2"
    older.write_bytes(b"events: Ir\nsummary: 5\n")
    newer.write_bytes(b"events: Ir\ntotals: 1234\n")
    os.utime(older, ns=(1, 1))
    assert instructions.dumped_instructions(tmp_path, "callgrind-pylon.out") == 1234
    with pytest.raises(RuntimeError, match="no dump"):
        instructions.dumped_instructions(tmp_path, "callgrind-candidate.out")
