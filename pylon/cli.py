"""Command line: `pylon serve`, `pylon mock-engine`, `pylon call`.

Every `serve` flag maps to one settings key (the table below), so a flag, its
`PYLON_*` environment variable and its config-file key always mean the same
thing. A bad flag or value exits non-zero with one readable line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from backends.mock import ENGINE_FLAVOURS, MockEngineOptions, serve_forever
from backends.registry import BACKEND_TYPES
from pylon.app import RunningPylon, StartupError, start_pylon
from pylon.config import Settings, load_settings, split_host_port
from pylon.logs import configure_logging
from pylon.signals import SecondSignal, ShutdownSignals
from pylon.supervisor import RunningSupervisor, supervise_until_signalled
from tunnel.steering import ConnectionIdSteering

logger = logging.getLogger("pylon")
T = TypeVar("T")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def comma_list(text: str) -> tuple[str, ...]:
    """A repeatable value in one flag: `a,b` -> ("a", "b"), blanks dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_tier_bands(text: str) -> list[dict[str, int]]:
    """`9:2,99:1` -> [{"max_level": 9, "tier": 2}, {"max_level": 99, "tier": 1}]."""
    bands = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        level, sep, tier = item.partition(":")
        if not sep or not level.strip().isdigit() or not tier.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected MAX_LEVEL:TIER, got {item!r}")
        bands.append({"max_level": int(level), "tier": int(tier)})
    return bands


@dataclass(frozen=True)
class Flag:
    flag: str
    key: str
    """Dotted settings key, e.g. "upstream.url"."""
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None
    boolean: bool = False
    """A switch: `--flag`, `--flag=false`, and `--no-flag` all work."""


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("--listen", "listen", "UDP HOST:PORT of the HTTP/3 tunnel", metavar="HOST:PORT"),
    Flag(
        "--admin-listen",
        "admin_listen",
        "TCP HOST:PORT for /metrics, /healthz, /readyz",
        metavar="HOST:PORT",
    ),
    Flag("--workers", "workers", "processes sharing the UDP port (one per core)", int, "N"),
    Flag("--drain-grace-s", "drain_grace_s", "SIGTERM grace for in-flight requests", float, "S"),
    Flag(
        "--quic-idle-timeout-s",
        "quic_idle_timeout_s",
        "close silent tunnel connections",
        float,
        "S",
    ),
    Flag(
        "--quic-ping-interval-s",
        "quic_ping_interval_s",
        "PING silent tunnel connections (0 disables)",
        float,
        "S",
    ),
    Flag(
        "--upstream", "upstream.url", "engine base URL, e.g. http://127.0.0.1:8000", metavar="URL"
    ),
    Flag(
        "--backend", "backend.type", f"engine adapter: {', '.join(BACKEND_TYPES)}", metavar="TYPE"
    ),
    Flag("--cert", "tls.cert_file", "PEM certificate chain", metavar="FILE"),
    Flag("--key", "tls.key_file", "PEM private key", metavar="FILE"),
    Flag("--client-ca", "auth.client_ca_file", "require gateway client certs from", metavar="FILE"),
    Flag(
        "--allowed-san",
        "auth.allowed_sans",
        "client-cert SANs accepted, comma-separated",
        comma_list,
        "NAME[,NAME...]",
    ),
    Flag("--token-file", "auth.token_file", "accepted bearer tokens", metavar="FILE"),
    Flag(
        "--insecure-no-auth",
        "auth.insecure_no_auth",
        "run without tunnel authentication (not with real traffic)",
        boolean=True,
    ),
    Flag("--dev", "dev", "generated certificate, built-in mock engine, human logs", boolean=True),
    Flag(
        "--derive-priority", "derive_priority", "derive engine priority (kill switch)", boolean=True
    ),
    Flag("--priority-ceiling", "priority.ceiling", "least urgent platform level", int, "N"),
    Flag(
        "--priority-absent",
        "priority.absent",
        "absent x-priority: lowest or omit",
        metavar="POLICY",
    ),
    Flag(
        "--dynamo-strict-tier-bands",
        "backend.strict_tier_bands",
        "Dynamo hard tiers, most urgent first: MAX_LEVEL:TIER,... e.g. 9:2,99:1",
        parse_tier_bands,
        "BANDS",
    ),
    Flag("--dynamo-strict-priority", "backend.strict_priority", "Dynamo strict tier", int, "N"),
    Flag(
        "--sglang-priority-scheduling",
        "backend.priority_scheduling",
        "the SGLang engine runs --enable-priority-scheduling",
        boolean=True,
    ),
    Flag(
        "--sglang-low-values-first",
        "backend.low_values_first",
        "the SGLang engine runs --schedule-low-priority-values-first",
        boolean=True,
    ),
    Flag("--sglang-scale", "backend.scale", "multiplier for SGLang priority values", int, "N"),
    Flag("--max-body-bytes", "limits.max_body_bytes", "largest request body", int, "BYTES"),
    Flag("--connect-timeout-s", "upstream.connect_timeout_s", "engine connect timeout", float, "S"),
    Flag(
        "--response-header-timeout-s",
        "upstream.response_header_timeout_s",
        "wait for the engine's response head (default: none)",
        float,
        "S",
    ),
    Flag(
        "--idle-timeout-s", "upstream.idle_timeout_s", "longest silence between chunks", float, "S"
    ),
    Flag("--total-timeout-s", "upstream.total_timeout_s", "deadline per request", float, "S"),
    Flag(
        "--upstream-transport",
        "upstream.transport",
        "HTTP/1.1 client: h11 (default) or httpcore (httpx's stock)",
        metavar="NAME",
    ),
    Flag(
        "--tracing",
        "tracing.enabled",
        "OpenTelemetry spans (OTLP, configured by OTEL_*)",
        boolean=True,
    ),
    Flag(
        "--event-loop",
        "event_loop",
        "auto (default: uvloop if installed), uvloop or asyncio",
        metavar="LOOP",
    ),
    Flag("--state-dir", "state_dir", "where --dev keeps its certificate", metavar="DIR"),
    Flag("--log-level", "log_level", "debug, info, warning or error", metavar="LEVEL"),
)


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML config file")
    for flag in SERVE_FLAGS:
        dest = flag.key.replace(".", "__")
        if flag.boolean:
            parser.add_argument(
                flag.flag,
                dest=dest,
                nargs="?",
                const=True,
                type=parse_bool,
                default=argparse.SUPPRESS,
                metavar="BOOL",
                help=flag.help,
            )
            parser.add_argument(
                "--no-" + flag.flag[2:],
                dest=dest,
                action="store_false",
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
        else:
            parser.add_argument(
                flag.flag,
                dest=dest,
                type=flag.type,
                metavar=flag.metavar,
                default=argparse.SUPPRESS,
                help=flag.help,
            )


def overrides_from(namespace: argparse.Namespace) -> dict[str, Any]:
    """Nested settings dict from the flags actually given."""
    overrides: dict[str, Any] = {}
    for dest, value in vars(namespace).items():
        if "__" not in dest and dest not in {f.key for f in SERVE_FLAGS}:
            continue
        *sections, leaf = dest.split("__")
        target = overrides
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value
    return overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pylon", description="HTTP/3 tunnel endpoint for LLM engines"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the tunnel endpoint")
    _add_serve_flags(serve)
    mock = commands.add_parser("mock-engine", help="run a mock inference engine")
    mock.add_argument("--engine", choices=ENGINE_FLAVOURS, default="openai")
    mock.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT")
    mock.add_argument("--tokens", type=int, default=16, metavar="N")
    mock.add_argument("--token-delay-ms", type=float, default=20.0, metavar="MS")
    mock.add_argument("--slots", type=int, default=None, metavar="N", help="concurrent generations")
    call = commands.add_parser("call", help="send one request over HTTP/3, like the gateway")
    call.add_argument("url", help="https://HOST:PORT/path")
    call.add_argument("-X", "--request", dest="method", default=None, metavar="METHOD")
    call.add_argument(
        "-H", "--header", dest="headers", action="append", default=[], metavar="'NAME: VALUE'"
    )
    call.add_argument("-d", "--data", default=None, metavar="BODY|@FILE")
    call.add_argument("--insecure", action="store_true", help="skip certificate verification")
    call.add_argument("--cacert", default=None, metavar="FILE", help="trust this CA / certificate")
    call.add_argument("--cert", default=None, metavar="FILE", help="client certificate (mTLS)")
    call.add_argument("--key", default=None, metavar="FILE", help="client certificate's key")
    return parser


def _fail(message: str) -> int:
    print(f"pylon: {message}", file=sys.stderr)
    return 2


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "settings"
    return f"invalid setting {where}: {first['msg']}" + (
        f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    )


def run_serve(namespace: argparse.Namespace) -> int:
    try:
        settings = load_settings(overrides=overrides_from(namespace), config_file=namespace.config)
    except ValidationError as error:
        return _fail(_describe(error))
    except (FileNotFoundError, ValueError) as error:
        return _fail(str(error))
    configure_logging(level=settings.log_level, human=settings.dev)
    serve = (
        supervise_until_signalled(settings, on_started=_print_supervisor_ready)
        if settings.workers > 1
        else serve_until_signalled(settings, on_started=_print_pylon_ready)
    )
    try:
        return run_event_loop(serve, choice=settings.event_loop)
    except StartupError as error:
        return _fail(str(error))
    except OSError as error:
        return _fail(f"cannot listen: {error}")


async def serve_until_signalled(
    settings: Settings,
    *,
    on_started: Callable[[RunningPylon], None],
    tunnel_socket: socket.socket | None = None,
    steering: ConnectionIdSteering | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain; a second signal stops at once."""
    pylon = await start_pylon(settings, tunnel_socket=tunnel_socket, steering=steering)
    signals = ShutdownSignals()
    on_started(pylon)
    try:
        await signals.first()
        logger.info("draining", extra={"grace_s": settings.drain_grace_s})
        try:
            drained = await signals.unless_another(pylon.drain(grace_s=settings.drain_grace_s))
        except SecondSignal:
            logger.warning("second signal: stopping without waiting for in-flight requests")
            return 1
        if not drained:
            logger.warning("drain grace period over: closing remaining streams")
        return 0
    finally:
        await pylon.close()


def run_event_loop(main: Coroutine[Any, Any, T], *, choice: str) -> T:
    """Run on uvloop or asyncio's own loop, as `event_loop` chooses (pylon.config)."""
    if choice == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:
        if choice == "auto":
            return asyncio.run(main)
        main.close()
        raise StartupError("event_loop = uvloop but uvloop is not installed") from None
    return uvloop.run(main)


def _print_pylon_ready(pylon: RunningPylon) -> None:
    settings = pylon.settings
    _print_ready(settings, port=pylon.port, upstream=pylon.upstream_url)
    print(f"pylon: admin on {split_host_port(settings.admin_listen)[0]}:{pylon.admin_port}")
    sys.stdout.flush()


def _print_supervisor_ready(supervisor: RunningSupervisor) -> None:
    settings = supervisor.settings
    _print_ready(settings, port=supervisor.port, upstream=supervisor.upstream_url)
    print(f"pylon: admin on {split_host_port(settings.admin_listen)[0]}:{supervisor.admin_port}")
    for worker in supervisor.workers.running():
        print(f"pylon: worker {worker.index} pid {worker.pid} admin 127.0.0.1:{worker.admin_port}")
    sys.stdout.flush()


def _print_ready(settings: Settings, *, port: int, upstream: str) -> None:
    host, _ = split_host_port(settings.listen)
    workers = f", {settings.workers} workers" if settings.workers > 1 else ""
    print(
        f"pylon: HTTP/3 tunnel on {host}:{port} -> {upstream}"
        f" (backend {settings.backend.type}{workers})"
    )
    if settings.dev:
        cert = settings.tls.cert_file or settings.state_dir / "dev-cert.pem"
        print(
            "pylon: try it:\n"
            f"  pylon call https://localhost:{port}/v1/chat/completions --cacert {cert} \\\n"
            "    -H 'x-request-id: demo-1' -H 'x-priority: 5' \\\n"
            "    -H 'content-type: application/json' \\\n"
            '    -d \'{"model":"mock-model","stream":true,'
            '"messages":[{"role":"user","content":"hi"}]}\'',
            flush=True,
        )


def run_mock_engine(namespace: argparse.Namespace) -> int:
    try:
        host, port = split_host_port(namespace.listen)
        options = MockEngineOptions(
            engine=namespace.engine,
            tokens=namespace.tokens,
            token_delay_s=namespace.token_delay_ms / 1000,
            slots=namespace.slots,
        )
    except ValueError as error:
        return _fail(str(error))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve_forever(
                options,
                host,
                port,
                on_ready=lambda engine: print(
                    f"mock {namespace.engine} engine on {engine.url}", flush=True
                ),
            )
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    if namespace.command == "serve":
        return run_serve(namespace)
    if namespace.command == "mock-engine":
        return run_mock_engine(namespace)
    from pylon.call import run_call

    return run_call(namespace)


if __name__ == "__main__":
    sys.exit(main())
