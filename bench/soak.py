"""`python -m bench soak`: is Pylon's memory flat across a long run?

Strategy: one mock engine and Pylon in front of it, started as `compare`
starts them (development certificate, bearer token, any `--pylon-arg`). The
`stream` load (256 streams in flight at 50 tokens/s by default) runs in
back-to-back windows of `window_s`, each a full `measure` run: streams
start spread over one stream's length, none starts after the window, the
last ones finish. After each window the bench records Pylon's RSS summed
over its process tree (the streams of the window have finished, so every
sample is taken in the same state), the window's VmHWM, load done, lost
events, errors and CPU. `soak_report` fits the trend over the second half.
Each window opens new QUIC connections, so connection set-up and teardown
are part of what is soaked.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import compare_report, heap_probe, soak_report, stack
from bench.compare import DEFAULTS
from bench.drivers import Target
from bench.load import LoadSpec
from bench.measure import measure
from bench.output import machine, results_dir, write_json
from bench.plots import soak_plot
from bench.procfs import background_busy_cores, process_tree, pss_bytes, rss_bytes
from bench.progress import note
from bench.stats import error_counts
from bench.table import fmt_mib, fmt_num
from bench.workloads import stream, with_headers
from pylon.devcert import ensure_dev_certificate

STREAM = DEFAULTS["stream"]
HEAP_DUMP_WAIT_S = 30.0
"""A snapshot of a large heap takes seconds; a probe that never answers fails the soak."""
MIN_STREAM_S = 0.001
"""Bounds the request budget of a window when the engine answers without delay."""


@dataclass(frozen=True)
class SoakOptions:
    duration_s: float = 600.0
    """Load time: the run has round(duration_s / window_s) windows (at least one)."""
    window_s: float = 30.0
    concurrency: int = STREAM.concurrency
    tokens: int = STREAM.tokens
    token_delay_ms: float = STREAM.token_delay_ms
    workers: int = 2
    """Load generator processes (Pylon's own `--workers` goes in `pylon_args`)."""
    streams_per_connection: int = 64
    max_growth_mib: float = soak_report.DEFAULT_MAX_GROWTH_MIB
    pylon_auth: bool = True
    pylon_args: tuple[str, ...] = ()
    pylon_command: tuple[str, ...] = ()
    python_heap: bool = False
    """Run Pylon under `bench.heap_probe` and record its traced Python heap per window."""
    out_root: Path | None = None

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.window_s <= 0:
            raise ValueError("--duration-s and --window-s must be positive")
        if self.python_heap and self.pylon_command:
            raise ValueError("--python-heap runs Pylon under the probe: no --pylon-command")
        if self.python_heap and any(arg.startswith("--workers") for arg in self.pylon_args):
            # Workers are interpreters of their own; the probe would trace the supervisor.
            raise ValueError("--python-heap traces one process: no Pylon --workers")

    @property
    def windows(self) -> int:
        return max(1, round(self.duration_s / self.window_s))

    @property
    def stream_s(self) -> float:
        return self.tokens * self.token_delay_ms / 1000

    @property
    def window_requests(self) -> int:
        """More than a window can complete: each slot finishes a stream at most every
        `stream_s`, so the window's duration, not this budget, ends it."""
        per_slot = math.ceil(self.window_s / max(self.stream_s, MIN_STREAM_S)) + 1
        return self.concurrency * per_slot


def run_soak(options: SoakOptions) -> dict[str, Any]:
    out = results_dir(options.out_root, name="soak")
    note(
        f"results in {out}; {options.windows} windows of {options.window_s:.0f} s, "
        f"{options.concurrency} streams in flight"
    )
    host = machine()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as running:
        tls = ensure_dev_certificate(Path(tmp) / "cert")
        token_file, auth = stack.write_token(Path(tmp)) if options.pylon_auth else (None, None)
        engine = running.enter_context(
            stack.engine(out, tokens=options.tokens, token_delay_ms=options.token_delay_ms)
        )
        pylon = running.enter_context(
            stack.pylon(
                out,
                upstream=engine.url,
                cert=tls[0],
                key=tls[1],
                token_file=token_file,
                extra_args=options.pylon_args,
                command=_heap_probe_command(out) if options.python_heap else options.pylon_command,
            )
        )
        idle_rss, idle_pss = rss_bytes(pylon.pid), pss_bytes(pylon.pid)
        windows = _windows(options, out, engine, pylon, [auth] if auth else [])
    host["background_busy_cores_after"] = round(background_busy_cores(), 2)
    idle = {"idle_rss_bytes": idle_rss, "idle_pss_bytes": idle_pss}
    return _report(options, out, windows, host=host, idle=idle)


def _windows(
    options: SoakOptions,
    out: Path,
    engine: stack.Service,
    pylon: stack.Service,
    headers: list[tuple[str, str]],
) -> list[dict[str, Any]]:
    pattern = with_headers(stream(tokens=options.tokens), headers)
    windows: list[dict[str, Any]] = []
    start = time.monotonic()
    for index in range(options.windows):
        spec = LoadSpec(
            target=Target("h3", stack.HOST, pylon.port),
            pattern=pattern,
            requests=options.window_requests,
            concurrency=options.concurrency,
            duration_s=options.window_s,
            ramp_s=options.stream_s,
            workers=options.workers,
            streams_per_connection=options.streams_per_connection,
            run_id=f"w{index + 1}",
        )
        label = f"window {index + 1}/{options.windows}"
        records, summary = measure(spec, engine=engine, proxy=pylon, label=label)
        window: dict[str, Any] = {"window": index + 1, "end_s": time.monotonic() - start}
        window |= {"rss_bytes": _alive_rss(pylon), "pss_bytes": pss_bytes(pylon.pid)}
        # A restarted worker starts small again and would hide growth: the pids show it.
        window["pids"] = process_tree(pylon.pid)
        if options.python_heap:
            window["python_heap"] = _heap_dump(pylon, out, index + 1)
        window |= {**summary, "error_kinds": error_counts(records)}
        note(_window_line(label, window))
        windows.append(window)
        # Kept up to date, so an interrupted or failed soak still leaves its windows.
        write_json(out / "soak.json", {"partial": True, "windows": windows})
    return windows


def _heap_probe_command(out: Path) -> tuple[str, ...]:
    return (sys.executable, "-m", "bench.heap_probe", str(out / "heap"))


def _heap_dump(pylon: stack.Service, out: Path, index: int) -> dict[str, Any]:
    """Ask the probe for dump `index` and read it (the loop runs the handler soon after)."""
    path = heap_probe.dump_path(out / "heap", index)
    os.kill(pylon.pid, signal.SIGUSR2)
    late = f"done with heap dump {path}"
    stack.wait_for(
        pylon, path.exists, timeout_s=HEAP_DUMP_WAIT_S, exited="before its dump", late=late
    )
    dump: dict[str, Any] = json.loads(path.read_text())
    return dump


def _alive_rss(pylon: stack.Service) -> int:
    rss = rss_bytes(pylon.pid)
    if pylon.process.poll() is not None or rss is None:
        raise RuntimeError(f"pylon exited during the soak:\n{stack.log_tail(pylon)}")
    return rss


def _window_line(label: str, window: dict[str, Any]) -> str:
    return (
        f"{label}: RSS {fmt_mib(window['rss_bytes'])} MiB "
        f"(peak {fmt_mib(window['proxy_peak_rss_bytes'])}), {window['ok']} ok, "
        f"{window['errors']} errors, {fmt_num(window['lost_events'], 0)} lost events, "
        f"Pylon CPU {fmt_num(window['proxy_cpu_s'])} s, "
        f"other CPU {fmt_num(window['other_cpu_s'])} s"
        + (
            f", heap {fmt_mib(window['python_heap']['traced_bytes'])} MiB"
            if "python_heap" in window
            else ""
        )
    )


def _report(
    options: SoakOptions,
    out: Path,
    windows: list[dict[str, Any]],
    *,
    host: dict[str, Any],
    idle: dict[str, int | None],
) -> dict[str, Any]:
    samples = [soak_report.Sample(w["end_s"], w["rss_bytes"]) for w in windows]
    max_growth = options.max_growth_mib * soak_report.MIB
    verdict = soak_report.soak_verdict(
        samples,
        window_peaks=[w["proxy_peak_rss_bytes"] for w in windows],
        max_growth_bytes=max_growth,
    )
    checks = soak_report.verdict_checks(verdict, max_growth_bytes=max_growth)
    totals = soak_report.totals(windows)
    result = {
        "partial": False,
        "command": ["python", "-m", "bench", *sys.argv[1:]],
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "machine": host,
        **idle,
        "windows": windows,
        "totals": totals,
        "verdict": asdict(verdict) | {"slope_mib_per_h": verdict.slope_mib_per_h},
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in checks],
    }
    write_json(out / "soak.json", result)
    print(f"\n== soak: {len(windows)} windows of {options.window_s:.0f} s ==")
    print(soak_report.windows_table(windows))
    print()
    print(soak_report.figures_table(verdict, idle=idle, last_pss_bytes=windows[-1]["pss_bytes"]))
    print()
    print(compare_report.targets_table(checks))
    if options.python_heap:
        print()
        print(soak_report.heap_table(windows))
    print(_totals_line(totals, host))
    soak_plot(out, samples, windows=windows, verdict=verdict)
    print(f"\nresults: {out}")
    return result


def _totals_line(totals: dict[str, float], host: dict[str, Any]) -> str:
    return (
        f"total: {totals['ok']:.0f} ok, {totals['errors']:.0f} errors, "
        f"{totals['events']:.0f} events, {totals['lost_events']:.0f} lost; Pylon busy "
        f"{totals['pylon_busy_cores']:.2f} cores, other work {totals['other_busy_cores']:.2f} cores"
        f" (before the soak: {host['background_busy_cores']:.2f}, "
        f"after: {host['background_busy_cores_after']:.2f})"
    )
