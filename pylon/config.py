"""The one root configuration object, built once at start-up and passed down.

Sources, highest first: CLI flags, `PYLON_*` environment variables (nested
sections with `__`, e.g. `PYLON_UPSTREAM__URL`), an optional TOML file, then
defaults. Unknown keys are errors everywhere (`extra="forbid"`), so a typo
fails loudly instead of silently running with a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from backends.config import BackendConfig, PassthroughConfig
from backends.priority import PriorityPolicy

MIB = 1 << 20


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsSettings(_Section):
    cert_file: Path | None = None
    """PEM certificate chain presented to the gateway."""
    key_file: Path | None = None
    """PEM private key for `cert_file`."""


class UpstreamSettings(_Section):
    url: str | None = None
    """Engine base URL, e.g. http://127.0.0.1:8000."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    response_header_timeout_s: float | None = Field(default=None, gt=0)
    """Wait for the engine's response head; unset by default because time to
    first token can be minutes under load."""
    idle_timeout_s: float = Field(default=300.0, gt=0)
    """Longest silence between two response chunks (or while sending the body)."""
    total_timeout_s: float | None = Field(default=None, gt=0)
    """Optional deadline for the whole exchange."""
    pool_timeout_s: float = Field(default=5.0, gt=0)
    """Wait for a free pooled connection before answering 503."""
    max_connections: int = Field(default=1024, ge=1)
    max_keepalive_connections: int = Field(default=256, ge=0)
    transport: Literal["h11", "httpcore"] = "h11"
    """HTTP/1.1 client under httpx: Pylon's own over asyncio (`pylon.upstream_request` writes,
    llhttp reads; "h11" is the name it was first built on), or httpx's
    stock httpcore (a fallback; it measured 1.4-2.2x the CPU per request)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/") if value else value


class LimitsSettings(_Section):
    max_body_bytes: int = Field(default=32 * MIB, ge=1)
    """Largest request body Pylon will buffer for sanitizing (413 beyond)."""
    max_queued_response_bytes: int = Field(default=1 * MIB, ge=16 * 1024)
    """Unacknowledged response bytes per stream before Pylon stops reading the engine."""
    request_window_bytes: int = Field(default=1 * MIB, ge=16 * 1024)
    """Request body bytes a gateway may send ahead of what Pylon has forwarded."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """Largest request header section, counted as RFC 9114 §4.2.2 does (name +
    value + 32 per field, pseudo-headers included): 431 beyond; a HEADERS
    frame over twice this is reset unread. Envoy's default is 60 KiB."""
    max_streams_per_connection: int = Field(default=512, ge=1)
    """Requests served at once on one tunnel connection: 503 (retry-safe) beyond."""
    max_streams_total: int = Field(default=1024, ge=1)
    """Requests served at once over all connections: 503 (retry-safe) beyond."""
    max_connections: int = Field(default=64, ge=1)
    """Open tunnel connections; a new one beyond is closed with CONNECTION_REFUSED."""
    request_body_idle_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for the next request body bytes: 408 if nothing reached the
    engine yet, else the stream is reset."""


DEFAULT_ALLOWED_HEADERS = (
    "content-type",
    "accept",
    "accept-encoding",
    "user-agent",
    "traceparent",
    "tracestate",
)
"""What an inference request needs; Pylon's own headers (x-request-id, the
derived priority headers) are always added on top."""


class AuthSettings(_Section):
    client_ca_file: Path | None = None
    """PEM CA bundle: the gateway must present a client certificate that chains
    to it (mTLS, checked in the QUIC handshake)."""
    allowed_sans: tuple[str, ...] = ()
    """DNS names or URIs the client certificate must carry one of (empty: any
    certificate from the CA). Needs client_ca_file."""
    token_file: Path | None = None
    """File of accepted bearer tokens, one per line (`authorization: Bearer ...`
    on every request); re-read when it changes."""
    insecure_no_auth: bool = False
    """Run with no tunnel authentication outside --dev (logged as a warning)."""

    @model_validator(mode="after")
    def _sans_need_a_ca(self) -> AuthSettings:
        if self.allowed_sans and self.client_ca_file is None:
            raise ValueError("allowed_sans needs client_ca_file")
        return self


class SecuritySettings(_Section):
    header_policy: Literal["denylist", "allowlist"] = "denylist"
    """`denylist` forwards every header but the deny-listed ones; `allowlist`
    forwards only allowed_headers (the deny-lists apply in both)."""
    allowed_headers: tuple[str, ...] = DEFAULT_ALLOWED_HEADERS
    """Headers forwarded in allowlist mode (names, case-insensitive)."""
    enable_0rtt: bool = False
    """Issue single-use resumption tickets so a reconnecting gateway can send
    0-RTT early data; early requests other than GET/HEAD/OPTIONS get 425.
    Not allowed with mTLS: a resumed session skips the certificate check."""

    @field_validator("allowed_headers")
    @classmethod
    def _lowercase(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name.strip().lower() for name in value)

    def header_allowlist(self) -> frozenset[bytes] | None:
        """The pipeline's form: the allowed names in allowlist mode, None in denylist mode."""
        if self.header_policy == "denylist":
            return None
        return frozenset(name.encode("latin-1") for name in self.allowed_headers)


class TracingSettings(_Section):
    enabled: bool = False
    """OpenTelemetry spans for tunnel and upstream requests; the OTLP exporter
    reads the standard OTEL_* variables (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PYLON_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    listen: str = "127.0.0.1:4433"
    """UDP address of the HTTP/3 tunnel listener (HOST:PORT)."""
    admin_listen: str = "127.0.0.1:9464"
    """TCP address of the admin server: /metrics, /healthz, /readyz (HOST:PORT)."""
    drain_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long in-flight requests may run before connections close.
    Keep Kubernetes terminationGracePeriodSeconds above this."""
    quic_idle_timeout_s: float = Field(default=60.0, gt=0)
    """A tunnel connection with no packets for this long is closed (both ends PING before)."""
    quic_ping_interval_s: float = Field(default=15.0, ge=0)
    """Pylon PINGs a tunnel connection silent this long, keeping NAT and firewall
    state alive and finding dead peers; 0 disables. Must be below quic_idle_timeout_s."""
    workers: int = Field(default=1, ge=1, le=64)
    """Processes serving the tunnel, each with its own event loop, sharing the UDP
    port (SO_REUSEPORT); one per core the pod may use. Above 1, a supervisor
    process restarts workers that die and serves their merged metrics."""
    dev: bool = False
    """Development mode: generated certificate, built-in mock engine, human logs."""
    state_dir: Path = Path(".pylon")
    """Where development state (the generated certificate) is kept."""
    log_level: str = "info"
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """`auto` runs on uvloop when it is installed (it is a dependency on Linux),
    else on asyncio's own loop: under load uvloop costs 0.6-0.75x its CPU per
    request and per streamed event (docs/performance.md). `uvloop` refuses to start without it."""
    derive_priority: bool = True
    """Kill switch for priority derivation; the trust-boundary strip is never switched off."""
    health_paths: tuple[str, ...] = ()
    """Extra health paths; each backend already knows its engine's health routes."""
    tls: TlsSettings = TlsSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    limits: LimitsSettings = LimitsSettings()
    tracing: TracingSettings = TracingSettings()
    auth: AuthSettings = AuthSettings()
    security: SecuritySettings = SecuritySettings()
    priority: PriorityPolicy = PriorityPolicy()
    backend: BackendConfig = PassthroughConfig()

    @field_validator("listen", "admin_listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in {"debug", "info", "warning", "error"}:
            raise ValueError("must be one of debug, info, warning, error")
        return value.lower()

    @model_validator(mode="after")
    def _ping_below_idle_timeout(self) -> Settings:
        # A PING only keeps a connection alive if it comes before the idle timeout.
        if self.quic_ping_interval_s >= self.quic_idle_timeout_s:
            raise ValueError("quic_ping_interval_s must be below quic_idle_timeout_s (0 disables)")
        return self


def split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def load_settings(*, overrides: dict[str, Any], config_file: Path | None) -> Settings:
    """Settings from CLI overrides > environment > TOML file > defaults."""

    class _Sourced(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            if config_file is None:
                return (init_settings, env_settings)
            toml = TomlConfigSettingsSource(settings_cls, toml_file=config_file)
            return (init_settings, env_settings, toml)

    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} not found")
    return Settings.model_validate(_Sourced(**overrides).model_dump())
