"""`python -m bench compare`: direct vs Pylon vs Caddy, in alternating rounds.

Strategy: one mock engine, Pylon (`--backend passthrough`) and Caddy in
front of it, all started once as subprocesses. Every path is warmed up, then
each round runs the same load against each path, starting with a different
path each round so no path always runs first. Around each run the bench
snapshots the proxy's and the engine's CPU time (/proc) and resets the
proxy's peak-RSS window. The report is the median over rounds of each
metric and of each per-round comparison (see `compare_report`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import compare_report, stack
from bench.drivers import Target
from bench.load import LoadSpec, run_load
from bench.measure import measure
from bench.output import interpreter, machine, results_dir, write_json
from bench.plots import compare_plots
from bench.procfs import pin_tree
from bench.progress import note
from bench.stats import Record, Summary, error_counts, median_summary
from bench.workloads import RequestSpec, small, stream, upload, with_headers
from pylon.devcert import ensure_dev_certificate


@dataclass(frozen=True)
class CompareOptions:
    workload: str
    rounds: int = 5
    requests: int | None = None
    concurrency: int | None = None
    rate_rps: float | None = None
    """Open loop at this rate instead of the closed-loop concurrency."""
    tokens: int | None = None
    token_delay_ms: float | None = None
    body_bytes: int = 1 << 20
    workers: int = 2
    warmup: int | None = None
    duration_s: float = 120.0
    with_caddy: bool = True
    caddy_access_log: bool = True
    """Caddy writes an access line per request, as Pylon does (False: Caddy's default, none)."""
    pylon_auth: bool = True
    """Bearer-token authentication on Pylon, as in production (Caddy has none)."""
    pylon_args: tuple[str, ...] = ()
    pylon_command: tuple[str, ...] = ()
    """Replaces `python -m pylon.cli` for the "pylon" path."""
    candidate_command: tuple[str, ...] = ()
    """Adds a "candidate" path: Pylon run as this command (e.g. a script that patches
    Pylon), measured in the same rounds, to evaluate a change without making it."""
    candidate_args: tuple[str, ...] = ()
    """Extra `pylon serve` flags for the candidate only (alone, they make a candidate
    of the stock Pylon with those flags, e.g. `--event-loop uvloop`)."""
    streams_per_connection: int = 64
    proxy_cpus: frozenset[int] = frozenset()
    """Pin each proxy (every Pylon process and thread, Caddy's threads) to these CPUs and
    the bench, its load generators and the engine to the others, as a node gives a
    proxy cores of its own. Empty: the scheduler places everything."""
    out_root: Path | None = None


@dataclass(frozen=True)
class _Defaults:
    requests: int
    concurrency: int
    tokens: int
    token_delay_ms: float


DEFAULTS = {
    "small": _Defaults(requests=2000, concurrency=16, tokens=16, token_delay_ms=0.0),
    "stream": _Defaults(requests=512, concurrency=256, tokens=100, token_delay_ms=20.0),
    "upload": _Defaults(requests=200, concurrency=8, tokens=1, token_delay_ms=0.0),
}
"""stream: 256 concurrent streams at 50 tokens/s (20 ms per token), the issue's target."""


def resolved(options: CompareOptions) -> CompareOptions:
    """Options with every workload default filled in."""
    d = DEFAULTS[options.workload]
    return replace(
        options,
        requests=options.requests or d.requests,
        concurrency=None if options.rate_rps else (options.concurrency or d.concurrency),
        tokens=options.tokens if options.tokens is not None else d.tokens,
        token_delay_ms=d.token_delay_ms
        if options.token_delay_ms is None
        else options.token_delay_ms,
    )


def _pattern(options: CompareOptions) -> tuple[RequestSpec, ...]:
    assert options.tokens is not None
    if options.workload == "small":
        return small(tokens=options.tokens)
    if options.workload == "stream":
        return stream(tokens=options.tokens)
    return upload(body_bytes=options.body_bytes)


@dataclass(frozen=True)
class _Path:
    """One way to the engine: where to send, what to measure, what to send."""

    target: Target
    proxy: stack.Service | None
    pattern: tuple[RequestSpec, ...]


def run_compare(options: CompareOptions) -> dict[str, Any]:
    options = resolved(options)
    out = results_dir(options.out_root, name=f"compare-{options.workload}")
    note(f"results in {out}")
    host = machine()
    pattern = _pattern(options)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as running:
        if options.proxy_cpus:
            running.enter_context(_others_off(options.proxy_cpus))
        tls = ensure_dev_certificate(Path(tmp) / "cert")
        token_file, auth = stack.write_token(Path(tmp)) if options.pylon_auth else (None, None)
        engine = running.enter_context(
            stack.engine(
                out, tokens=options.tokens or 0, token_delay_ms=options.token_delay_ms or 0
            )
        )
        paths = {"direct": _Path(Target("h1", stack.HOST, engine.port), None, pattern)}
        pylon_pattern = with_headers(pattern, [auth] if auth else [])
        commands: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
            "pylon": (options.pylon_command, ())
        }
        if options.candidate_command or options.candidate_args:
            commands["candidate"] = (options.candidate_command, options.candidate_args)
        for name, (command, args) in commands.items():
            service = running.enter_context(
                stack.pylon(
                    out,
                    upstream=engine.url,
                    cert=tls[0],
                    key=tls[1],
                    token_file=token_file,
                    extra_args=(*options.pylon_args, *args),
                    command=command,
                    name=name,
                )
            )
            _pin(service, options.proxy_cpus)
            paths[name] = _Path(Target("h3", stack.HOST, service.port), service, pylon_pattern)
            host.setdefault("interpreters", {})[name] = described = interpreter(service.pid)
            note(f"{name} runs on {_interpreter_text(described)}")
        if options.with_caddy and stack.caddy_binary() is not None:
            caddy = running.enter_context(
                stack.caddy(
                    out,
                    upstream_port=engine.port,
                    cert=tls[0],
                    key=tls[1],
                    access_log=options.caddy_access_log,
                )
            )
            _pin(caddy, options.proxy_cpus)
            paths["caddy"] = _Path(Target("h3", stack.HOST, caddy.port), caddy, pattern)
        elif options.with_caddy:
            note("caddy not found: comparing without it (apt-get install -y caddy)")
        return _rounds(options, out, engine, paths, host)


@contextlib.contextmanager
def _others_off(proxy_cpus: frozenset[int]) -> Iterator[None]:
    """Keep this process, and what it starts from now on, off `proxy_cpus`; restored
    on exit (tests run the bench in their own process)."""
    allowed = frozenset(os.sched_getaffinity(0))
    others = allowed - proxy_cpus
    if not proxy_cpus <= allowed or not others:
        raise ValueError(f"--pin-proxy {sorted(proxy_cpus)} must leave this process a CPU")
    os.sched_setaffinity(0, others)
    note(f"proxies on CPUs {sorted(proxy_cpus)}, everything else on {sorted(others)}")
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    return sorted(value) if isinstance(value, frozenset) else value


def _pin(service: stack.Service, cpus: frozenset[int]) -> None:
    if cpus:
        pin_tree(service.pid, cpus)


def _interpreter_text(described: dict[str, Any] | None) -> str:
    if described is None:
        return "no Python found in its process tree"
    if "version" not in described:
        return f"{described['executable']} (not described)"
    flags = ", ".join(described["build_flags"]) or "no PGO/LTO flags recorded"
    linked = "shared" if described["shared_libpython"] else "static"
    return (
        f"Python {described['version']} at {described['executable']} ({flags}; {linked} libpython)"
    )


def _rounds(
    options: CompareOptions,
    out: Path,
    engine: stack.Service,
    paths: dict[str, _Path],
    host: dict[str, Any],
) -> dict[str, Any]:
    for name, path in paths.items():
        warmup = options.warmup or options.concurrency or 50
        run_load(_spec(options, path, requests=warmup), label=f"warm-up {name}")
    rounds: list[dict[str, Any]] = []
    samples: dict[str, list[Record]] = {name: [] for name in paths}
    names = list(paths)
    for index in range(options.rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        by_path: dict[str, Summary] = {}
        errors: dict[str, dict[str, int]] = {}
        for name in order:
            spec = _spec(options, paths[name], run_id=f"r{index}-{name}")
            label = f"round {index + 1}/{options.rounds} {name}"
            proxy = paths[name].proxy
            records, by_path[name] = measure(spec, engine=engine, proxy=proxy, label=label)
            errors[name] = error_counts(records)
            samples[name].extend(records)
        rounds.append({"round": index + 1, "order": order, "paths": by_path, "errors": errors})
    return _report(options, out, rounds, samples, host)


def _spec(
    options: CompareOptions, path: _Path, *, requests: int | None = None, run_id: str = "warm"
) -> LoadSpec:
    return LoadSpec(
        target=path.target,
        pattern=path.pattern,
        requests=requests or options.requests or 1,
        concurrency=options.concurrency,
        rate_rps=options.rate_rps,
        duration_s=options.duration_s,
        ramp_s=_ramp_s(options),
        workers=options.workers,
        streams_per_connection=options.streams_per_connection,
        run_id=run_id,
    )


def _ramp_s(options: CompareOptions) -> float:
    """Streams start spread over one stream's length: a steady `concurrency` streams."""
    if options.workload != "stream" or not options.tokens or not options.token_delay_ms:
        return 0.0
    return options.tokens * options.token_delay_ms / 1000


def _report(
    options: CompareOptions,
    out: Path,
    rounds: list[dict[str, Any]],
    samples: dict[str, list[Record]],
    host: dict[str, Any],
) -> dict[str, Any]:
    medians = {name: median_summary([r["paths"][name] for r in rounds]) for name in samples}
    comparison = compare_report.median_comparison([r["paths"] for r in rounds])
    checks = compare_report.target_checks(options.workload, medians, comparison)
    result = {
        "command": ["python", "-m", "bench", *sys.argv[1:]],
        "options": {k: _jsonable(v) for k, v in asdict(options).items()},
        "machine": host,
        "rounds": rounds,
        "medians": medians,
        "comparison": comparison,
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in checks],
    }
    write_json(out / "compare.json", result)
    print(f"\n== compare {options.workload}: medians over {options.rounds} rounds ==")
    print(compare_report.paths_table(medians))
    print()
    print(compare_report.ratios_table(comparison))
    print()
    print(compare_report.targets_table(checks))
    compare_plots(out, options.workload, samples)
    print(f"\nresults: {out}")
    return result
