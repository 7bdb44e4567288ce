"""`python -m bench compare | priority | soak | load`: the command line of the bench.

Progress goes to stderr, the summary tables to stdout, and everything
measured to `bench/results/<timestamp>-<command>/` as JSON (plus PNG plots
when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import NoReturn

from bench.compare import DEFAULTS, CompareOptions, run_compare
from bench.drivers import Target
from bench.load import LoadSpec, run_load
from bench.output import machine, results_dir, write_json
from bench.priority import BACKENDS, DEFAULT_CLASSES, I32_MAX, PriorityOptions, run_priority
from bench.procfs import parse_cpu_list
from bench.progress import note
from bench.sendpath import report as sendpath_report
from bench.sendpath import run_sendpath
from bench.soak import STREAM, SoakOptions, run_soak
from bench.soak_report import DEFAULT_MAX_GROWTH_MIB
from bench.stats import error_counts, summarize
from bench.table import fmt_ms, fmt_num, format_table
from bench.workloads import parse_classes, small, stream, upload, with_headers

PROTOCOLS = {"https": "h3", "http": "h1"}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="load generator processes")
    parser.add_argument("--out", type=Path, default=None, help="results root (bench/results)")


def _load_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, default=None, help="closed loop")
    shape.add_argument("--rate", type=float, default=None, metavar="RPS", help="open loop")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per completion")
    parser.add_argument("--body-bytes", type=int, default=1 << 20, help="upload body size")
    parser.add_argument("--duration-s", type=float, default=120.0, help="no request starts later")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description="Pylon benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser("compare", help="direct vs Pylon vs Caddy, alternating rounds")
    compare.add_argument("--workload", choices=sorted(DEFAULTS), required=True)
    compare.add_argument("--rounds", type=int, default=5)
    compare.add_argument("--token-delay-ms", type=float, default=None, help="engine token delay")
    compare.add_argument("--warmup", type=int, default=None, help="warm-up requests per path")
    compare.add_argument("--no-caddy", action="store_true", help="skip the Caddy path")
    compare.add_argument(
        "--caddy-no-access-log",
        action="store_true",
        help="Caddy without its access log (Pylon still writes one)",
    )
    compare.add_argument(
        "--pylon-no-auth", action="store_true", help="--insecure-no-auth instead of a token"
    )
    compare.add_argument(
        "--pylon-arg", action="append", default=[], metavar="ARG", help="extra `pylon serve` arg"
    )
    compare.add_argument(
        "--pylon-command",
        default=None,
        metavar="CMD",
        help="run Pylon as CMD instead of `python -m pylon.cli` (experiments)",
    )
    compare.add_argument(
        "--candidate-command",
        default=None,
        metavar="CMD",
        help="add a 'candidate' path: Pylon run as CMD (a patched Pylon), same rounds",
    )
    compare.add_argument(
        "--candidate-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `pylon serve` arg for the candidate only (alone: stock Pylon + ARGs)",
    )
    compare.add_argument(
        "--streams-per-connection", type=int, default=64, help="HTTP/3 streams per QUIC connection"
    )
    compare.add_argument(
        "--pin-proxy",
        type=parse_cpu_list,
        default=frozenset(),
        metavar="CPUS",
        help="run each proxy on these CPUs (e.g. 1 or 2-3) and everything else on the rest",
    )
    _load_shape(compare)
    _common(compare)
    prio = commands.add_parser("priority", help="per-class TTFT under overload, two policies")
    prio.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    prio.add_argument("--ceilings", default=f"1000,{I32_MAX}", help="comma-separated")
    prio.add_argument("--classes", default=DEFAULT_CLASSES, help="PRIORITY:SHARE,...; none=absent")
    prio.add_argument("--slots", type=int, default=4)
    prio.add_argument("--tokens", type=int, default=10)
    prio.add_argument("--token-delay-ms", type=float, default=20.0)
    prio.add_argument("--duration-s", type=float, default=20.0)
    prio.add_argument("--drain-s", type=float, default=5.0)
    _common(prio)
    _soak_parser(commands.add_parser("soak", help="Pylon's RSS across a long stream run"))
    sendpath = commands.add_parser(
        "sendpath", help="the QUIC send path alone, in memory: CPU per event, hooked vs plain"
    )
    sendpath.add_argument("--streams", type=int, default=256)
    sendpath.add_argument("--tokens-per-s", type=float, default=50.0, help="per stream")
    sendpath.add_argument("--duration-s", type=float, default=2.0, help="simulated, per run")
    sendpath.add_argument("--rounds", type=int, default=5, help="runs of each, alternated")
    sendpath.add_argument("--out", type=Path, default=None, help="results root (bench/results)")
    load = commands.add_parser("load", help="one load against any URL (h3 for https://)")
    load.add_argument("url", help="https://HOST:PORT (HTTP/3) or http://HOST:PORT (HTTP/1.1)")
    load.add_argument("--workload", choices=sorted(DEFAULTS), default="small")
    load.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'")
    _load_shape(load)
    _common(load)
    return parser


def _soak_parser(soak: argparse.ArgumentParser) -> None:
    soak.add_argument("--duration-s", type=float, default=600.0, help="load time, all windows")
    soak.add_argument("--window-s", type=float, default=30.0, help="RSS is sampled after each")
    soak.add_argument("--concurrency", type=int, default=STREAM.concurrency, help="streams")
    soak.add_argument("--tokens", type=int, default=STREAM.tokens, help="tokens per stream")
    soak.add_argument("--token-delay-ms", type=float, default=STREAM.token_delay_ms)
    soak.add_argument(
        "--max-growth-mib",
        type=float,
        default=DEFAULT_MAX_GROWTH_MIB,
        help="flat: less growth over the second half",
    )
    soak.add_argument(
        "--pylon-no-auth", action="store_true", help="--insecure-no-auth instead of a token"
    )
    soak.add_argument(
        "--pylon-arg", action="append", default=[], metavar="ARG", help="extra `pylon serve` arg"
    )
    soak.add_argument(
        "--pylon-command", default=None, metavar="CMD", help="run Pylon as CMD (experiments)"
    )
    soak.add_argument(
        "--streams-per-connection", type=int, default=64, help="HTTP/3 streams per QUIC connection"
    )
    soak.add_argument(
        "--python-heap",
        action="store_true",
        help="Pylon under tracemalloc: its live Python heap and growing sites per window",
    )
    _common(soak)


def run_soak_command(ns: argparse.Namespace) -> int:
    options = SoakOptions(
        duration_s=ns.duration_s,
        window_s=ns.window_s,
        concurrency=ns.concurrency,
        tokens=ns.tokens,
        token_delay_ms=ns.token_delay_ms,
        workers=ns.workers,
        streams_per_connection=ns.streams_per_connection,
        max_growth_mib=ns.max_growth_mib,
        pylon_auth=not ns.pylon_no_auth,
        pylon_args=tuple(ns.pylon_arg),
        pylon_command=tuple(shlex.split(ns.pylon_command or "")),
        python_heap=ns.python_heap,
        out_root=ns.out,
    )
    run_soak(options)
    return 0


def run_sendpath_command(ns: argparse.Namespace) -> int:
    runs = run_sendpath(
        streams=ns.streams,
        tokens_per_s=ns.tokens_per_s,
        duration_s=ns.duration_s,
        rounds=ns.rounds,
    )
    print(sendpath_report(runs))
    out = results_dir(ns.out, name="sendpath")
    write_json(
        out / "sendpath.json",
        {
            "machine": machine(),
            "streams": ns.streams,
            "tokens_per_s": ns.tokens_per_s,
            "duration_s": ns.duration_s,
            "runs": [
                {"hooked": r.hooked, "events": r.events, "server_cpu_s": r.server_cpu_s}
                for r in runs
            ],
        },
    )
    print(f"results: {out}")
    return 0


def run_compare_command(ns: argparse.Namespace) -> int:
    options = CompareOptions(
        workload=ns.workload,
        rounds=ns.rounds,
        requests=ns.requests,
        concurrency=ns.concurrency,
        rate_rps=ns.rate,
        tokens=ns.tokens,
        token_delay_ms=ns.token_delay_ms,
        body_bytes=ns.body_bytes,
        workers=ns.workers,
        warmup=ns.warmup,
        duration_s=ns.duration_s,
        with_caddy=not ns.no_caddy,
        caddy_access_log=not ns.caddy_no_access_log,
        pylon_auth=not ns.pylon_no_auth,
        pylon_args=tuple(ns.pylon_arg),
        pylon_command=tuple(shlex.split(ns.pylon_command or "")),
        candidate_command=tuple(shlex.split(ns.candidate_command or "")),
        candidate_args=tuple(ns.candidate_arg),
        streams_per_connection=ns.streams_per_connection,
        proxy_cpus=ns.pin_proxy,
        out_root=ns.out,
    )
    run_compare(options)
    return 0


def run_priority_command(ns: argparse.Namespace) -> int:
    options = PriorityOptions(
        backends=BACKENDS if ns.backend == "all" else (ns.backend,),
        ceilings=tuple(int(c) for c in ns.ceilings.split(",")),
        classes=parse_classes(ns.classes),
        slots=ns.slots,
        tokens=ns.tokens,
        token_delay_ms=ns.token_delay_ms,
        duration_s=ns.duration_s,
        drain_s=ns.drain_s,
        workers=ns.workers,
        out_root=ns.out,
    )
    run_priority(options)
    return 0


def run_load_command(ns: argparse.Namespace) -> int:
    scheme, _, rest = ns.url.partition("://")
    host, _, port = rest.rstrip("/").rpartition(":")
    if scheme not in PROTOCOLS or not port.isdigit():
        raise ValueError(f"{ns.url!r}: expected https://HOST:PORT or http://HOST:PORT")
    headers = [tuple(part.strip() for part in h.split(":", 1)) for h in ns.header]
    builders = {
        "small": lambda: small(tokens=ns.tokens or 16),
        "stream": lambda: stream(tokens=ns.tokens or 100),
        "upload": lambda: upload(body_bytes=ns.body_bytes),
    }
    pattern = with_headers(builders[ns.workload](), [(k, v) for k, v in headers])
    spec = LoadSpec(
        target=Target(PROTOCOLS[scheme], host.strip("[]"), int(port)),
        pattern=pattern,
        requests=ns.requests or DEFAULTS[ns.workload].requests,
        concurrency=None if ns.rate else (ns.concurrency or DEFAULTS[ns.workload].concurrency),
        rate_rps=ns.rate,
        duration_s=ns.duration_s,
        workers=ns.workers,
    )
    result = run_load(spec, label=ns.url)
    summary = summarize(result.records, wall_s=result.wall_s)
    out = results_dir(ns.out, name="load")
    write_json(
        out / "load.json",
        {
            "command": ["python", "-m", "bench", *sys.argv[1:]],
            "summary": summary | {"client_cpu_s": result.client_cpu_s},
            "errors": error_counts(result.records),
            "records": [asdict(r) for r in result.records],
        },
    )
    headers_row = ["url", "ok", "err", "req/s", "TTFB p50", "TTFB p99", "gap p99", "lost"]
    row = [
        ns.url,
        fmt_num(summary["ok"]),
        fmt_num(summary["errors"]),
        fmt_num(summary["throughput_rps"]),
        fmt_ms(summary["ttfb_p50_s"]),
        fmt_ms(summary["ttfb_p99_s"]),
        fmt_ms(summary["gap_p99_s"]),
        fmt_num(summary["lost_events"]),
    ]
    print(format_table(headers_row, [row]) + "\n(times in ms)")
    print(f"results: {out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "compare": run_compare_command,
    "priority": run_priority_command,
    "soak": run_soak_command,
    "load": run_load_command,
    "sendpath": run_sendpath_command,
}


# `kill`, `timeout` and a closed terminal send these, not SIGINT.
TERMINATIONS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(_signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _terminations_interrupt() -> Iterator[None]:
    """Unwind on SIGTERM or SIGHUP as on Ctrl-C, so the `finally` blocks stop every
    process the bench started instead of leaving the engine and Pylon running."""
    previous = {termination: signal.signal(termination, _interrupt) for termination in TERMINATIONS}
    try:
        yield
    finally:
        for termination, handler in previous.items():
            signal.signal(termination, handler)


def main(argv: Sequence[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    with _terminations_interrupt():
        return _run(namespace)


def _run(namespace: argparse.Namespace) -> int:
    try:
        return COMMANDS[namespace.command](namespace)
    except KeyboardInterrupt:
        note("interrupted: every process the bench started has been stopped")
        return 130
    except (ValueError, RuntimeError, TimeoutError, FileNotFoundError) as error:
        note(f"bench: {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
