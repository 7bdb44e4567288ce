"""Tunnel authentication: mTLS in the QUIC handshake, bearer tokens on every request.

End to end over real QUIC: a refused peer never gets a request stream served
and the engine never sees a request. Start-up refuses to run unauthenticated
outside --dev. The TLS verification itself is also driven in memory (no
sockets) for the cases that need no engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode
from aioquic.tls import AlertDescription

from backends.mock import MockEngineOptions
from pylon.app import StartupError, start_pylon
from pylon.auth import TokenFile, bearer_token, parse_tokens, token_accepted, token_digest
from pylon.cli import build_parser, overrides_from
from pylon.config import Settings, load_settings
from pylon.devcert import ensure_dev_certificate
from tests.harness import CHAT, Stack, run, stack, tunnel_headers
from tests.security_kit import STARGATE_DNS, STARGATE_URI, Pki, RecordingClient, make_pki
from tunnel.client import H3Client, client_configuration
from tunnel.tls import (
    ClientAuth,
    Refusal,
    allowed_sans_from,
    load_ca_bundle,
    peer_identity,
    require_client_certificate,
)
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

BODY = orjson.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
BACKEND = "passthrough"
CLIENT_ADDR = ("1.2.3.4", 1234)
SERVER_ADDR = ("2.3.4.5", 4433)


def crypto_error(alert: AlertDescription) -> int:
    return QuicErrorCode.CRYPTO_ERROR + int(alert)


@contextlib.asynccontextmanager
async def mtls_client(s: Stack, pair: tuple[Path, Path] | None) -> AsyncIterator[RecordingClient]:
    configuration = client_configuration(verify=False)
    if pair is not None:
        configuration.load_cert_chain(*pair)
    async with connect(
        "127.0.0.1", s.pylon.port, configuration=configuration, create_protocol=RecordingClient
    ) as client:
        assert isinstance(client, RecordingClient)
        yield client


def engine_saw_inference(s: Stack) -> bool:
    assert s.engine is not None
    return any(record["path"] == CHAT for record in s.engine.snapshot()["requests"])


async def refused_with(s: Stack, pair: tuple[Path, Path] | None) -> int:
    """Try a request with this client certificate; the connection's close code."""
    async with mtls_client(s, pair) as client:
        with pytest.raises(StreamAborted):
            await client.request("POST", CHAT, headers=tunnel_headers("r-1"), body=BODY)
        await client.wait_closed()
        assert client.terminated is not None
        return client.terminated.error_code


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- mTLS end to end ------------------------------------------------------------------


def test_mtls_admits_the_gateway_and_refuses_everyone_else(tmp_path: Path, pki: Pki) -> None:
    """One stack, every refusal: none of them is served, the engine sees only the good one."""
    auth = {"client_ca_file": str(pki.ca_file), "allowed_sans": [STARGATE_URI]}
    cases = [
        (None, AlertDescription.certificate_required, Refusal.NO_CLIENT_CERTIFICATE),
        (
            pki.foreign_client,
            AlertDescription.bad_certificate,
            Refusal.UNTRUSTED_CLIENT_CERTIFICATE,
        ),
        (pki.wrong_san_client, AlertDescription.access_denied, Refusal.SAN_NOT_ALLOWED),
    ]

    async def scenario() -> None:
        async with stack(tmp_path, auth=auth) as s:
            for pair, alert, refusal in cases:
                assert await refused_with(s, pair) == crypto_error(alert)
                assert (
                    s.metric(
                        "pylon_connections_refused_total", backend=BACKEND, reason=refusal.value
                    )
                    == 1
                )
            assert not engine_saw_inference(s), "a refused peer reached the engine"
            assert (
                s.metric(
                    "pylon_requests_total", backend=BACKEND, route="inference", status_class="2xx"
                )
                == 0
            )
            async with mtls_client(s, pki.client) as client:
                response = await client.request(
                    "POST", CHAT, headers=tunnel_headers("ok"), body=BODY
                )
                assert response.status == 200
                await response.read()
            assert engine_saw_inference(s)

    run(scenario())


def test_mtls_without_an_allow_list_accepts_any_certificate_from_the_ca(
    tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        async with stack(tmp_path, auth={"client_ca_file": str(pki.ca_file)}) as s:
            async with mtls_client(s, pki.wrong_san_client) as client:
                response = await client.request(
                    "POST", CHAT, headers=tunnel_headers("any"), body=BODY
                )
                assert response.status == 200
                await response.read()
            assert await refused_with(s, pki.foreign_client) == crypto_error(
                AlertDescription.bad_certificate
            )

    run(scenario())


# --- the TLS check in memory ----------------------------------------------------------


def handshake(tmp_path: Path, pki: Pki, pair: tuple[Path, Path] | None, allowed: list[str]) -> Any:
    """Client and server QuicConnections exchanging datagrams directly; the server."""
    cert, key = ensure_dev_certificate(tmp_path)
    server_config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    server_config.load_cert_chain(cert, key)
    client_config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    client_config.verify_mode = ssl.CERT_NONE
    if pair is not None:
        client_config.load_cert_chain(*pair)
    client = QuicConnection(configuration=client_config)
    server = QuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
    )
    auth = ClientAuth(load_ca_bundle(pki.ca_file), allowed_sans_from(allowed))
    refusals: list[Refusal] = []
    require_client_certificate(server, auth, on_refused=refusals.append)
    client.connect(SERVER_ADDR, now=0.0)
    now = 0.0
    for _ in range(10):
        now += 0.001
        for data, _ in client.datagrams_to_send(now=now):
            server.receive_datagram(data, CLIENT_ADDR, now=now)
        for data, _ in server.datagrams_to_send(now=now):
            client.receive_datagram(data, SERVER_ADDR, now=now)
    return server, refusals


@pytest.mark.parametrize(
    ("which", "allowed", "alert"),
    [
        ("expired_client", [], AlertDescription.certificate_expired),
        ("server_usage_client", [], AlertDescription.bad_certificate),
        ("foreign_client", [], AlertDescription.bad_certificate),
        ("wrong_san_client", [STARGATE_DNS.upper()], AlertDescription.access_denied),
        (None, [], AlertDescription.certificate_required),
    ],
    ids=["expired", "server-usage-only", "other-ca", "wrong-san", "no-certificate"],
)
def test_untrusted_client_certificates_fail_the_handshake(
    tmp_path: Path, pki: Pki, which: str | None, allowed: list[str], alert: AlertDescription
) -> None:
    pair = getattr(pki, which) if which is not None else None
    server, refusals = handshake(tmp_path, pki, pair, allowed)
    assert not server._handshake_complete
    assert server._close_event is not None
    assert server._close_event.error_code == crypto_error(alert)
    assert len(refusals) == 1
    assert peer_identity(server) is None


@pytest.mark.parametrize(
    ("allowed", "identity"),
    [([], STARGATE_DNS), ([STARGATE_URI], STARGATE_URI), ([STARGATE_DNS.upper()], STARGATE_DNS)],
    ids=["any-san", "uri-san", "dns-san-any-case"],
)
def test_trusted_client_certificate_completes_the_handshake(
    tmp_path: Path, pki: Pki, allowed: list[str], identity: str
) -> None:
    server, refusals = handshake(tmp_path, pki, pki.client, allowed)
    assert server._handshake_complete
    assert refusals == []
    assert peer_identity(server) == identity


def test_a_ca_file_without_certificates_is_rejected(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_text("not a certificate\n")
    with pytest.raises(ValueError):
        load_ca_bundle(empty)


# --- bearer tokens --------------------------------------------------------------------


def write_tokens(path: Path, *tokens: str) -> None:
    """Replace the file atomically, as a rotation should."""
    staging = path.with_suffix(".new")
    staging.write_text("# accepted tokens\n" + "".join(f"{token}\n" for token in tokens))
    os.replace(staging, path)


async def call(s: Stack, client: H3Client, request_id: str, token: str | None) -> int:
    headers = tunnel_headers(request_id)
    if token is not None:
        headers.append(("authorization", f"Bearer {token}"))
    response = await client.request("POST", CHAT, headers=headers, body=BODY)
    body = await response.read()
    if response.status == 401:
        assert orjson.loads(body)["error"]["code"] == "unauthorized"
        assert response.header("www-authenticate") == "Bearer"
    return response.status


def test_token_is_required_checked_rotated_and_never_forwarded(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, "first-token", "second-token")

    async def scenario() -> None:
        async with stack(tmp_path, auth={"token_file": str(tokens)}) as s, s.client() as client:
            assert s.engine is not None
            assert await call(s, client, "none", None) == 401
            assert await call(s, client, "wrong", "first-tokeX") == 401
            assert await call(s, client, "prefix", "first") == 401
            assert not engine_saw_inference(s), "a request without a good token reached it"
            rejected = s.metric(
                "pylon_requests_rejected_total", backend=BACKEND, reason="unauthorized"
            )
            assert rejected == 3
            assert await call(s, client, "ok-1", "second-token") == 200
            (record,) = [r for r in s.engine.snapshot()["requests"] if r["path"] == CHAT]
            assert "authorization" not in {name.lower() for name, _ in record["headers"]}
            write_tokens(tokens, "third-token")
            assert await call(s, client, "rotated-out", "second-token") == 401
            assert await call(s, client, "rotated-in", "third-token") == 200

    run(scenario())


def test_authorization_is_stripped_even_without_token_auth(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            assert s.engine is not None
            assert await call(s, client, "dev", "client-secret") == 200
            (record,) = [r for r in s.engine.snapshot()["requests"] if r["path"] == CHAT]
            assert "authorization" not in {name.lower() for name, _ in record["headers"]}

    run(scenario())


def test_allowlist_mode_forwards_only_allowed_headers_and_pylons_own(tmp_path: Path) -> None:
    engine = MockEngineOptions(engine="dynamo")
    extra = [("x-custom", "1"), ("accept", "application/json"), ("cookie", "c=1")]

    async def scenario() -> None:
        async with (
            stack(
                tmp_path,
                engine=engine,
                backend={"type": "dynamo"},
                security={"header_policy": "allowlist"},
            ) as s,
            s.client() as client,
        ):
            assert s.engine is not None
            headers = [*tunnel_headers("allow", x_priority="3"), *extra]
            response = await client.request("POST", CHAT, headers=headers, body=BODY)
            assert response.status == 200
            await response.read()
            (record,) = [r for r in s.engine.snapshot()["requests"] if r["path"] == CHAT]
            received = {name.lower() for name, _ in record["headers"]}
            assert {"content-type", "accept", "x-request-id"} <= received
            assert {"x-dynamo-request-priority", "x-dynamo-request-strict-priority"} <= received
            assert not received & {"x-custom", "cookie", "x-priority"}

    run(scenario())


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ([(b"authorization", b"Bearer abc")], b"abc"),
        ([(b"Authorization", b"bearer   abc  ")], b"abc"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer")], None),
        ([(b"authorization", b"Bearer ")], None),
        ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer a")], None),
        ([], None),
    ],
    ids=["plain", "casing-and-space", "basic", "no-token", "empty-token", "twice", "absent"],
)
def test_bearer_token_parsing(headers: list[tuple[bytes, bytes]], token: bytes | None) -> None:
    assert bearer_token(headers) == token


def test_token_file_keeps_the_last_good_tokens_while_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    write_tokens(path, "kept")
    tokens = TokenFile(path)
    path.unlink()
    assert token_accepted(b"kept", tokens.digests())
    write_tokens(path, "new")
    assert not token_accepted(b"kept", tokens.digests())
    assert token_accepted(b"new", tokens.digests())
    path.write_text("# all revoked\n")
    assert tokens.digests() == ()


def test_token_comparison() -> None:
    digests = [token_digest(t) for t in parse_tokens(b"# c\n a \n\nb\n")]
    assert [token_accepted(t, digests) for t in (b"a", b"b", b"c", b"# c", b"", None)] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


# --- start-up -------------------------------------------------------------------------


def production_settings(tmp_path: Path, **auth: Any) -> Settings:
    cert, key = ensure_dev_certificate(tmp_path / "tls")
    return Settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        tls={"cert_file": cert, "key_file": key},
        upstream={"url": "http://127.0.0.1:9"},
        auth=auth,
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "tunnel authentication is required"),
        ({"token_file": "/nonexistent/tokens"}, "cannot read token file"),
        ({"client_ca_file": "/nonexistent/ca.pem"}, "cannot load client CA"),
    ],
    ids=["no-auth", "missing-token-file", "missing-ca"],
)
def test_start_up_refuses_without_working_auth(
    tmp_path: Path, settings: dict[str, str], message: str
) -> None:
    async def scenario() -> None:
        with pytest.raises(StartupError, match=message):
            await start_pylon(production_settings(tmp_path, **settings))

    run(scenario())


def test_auth_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PYLON_")]:
        monkeypatch.delenv(name)
    argv = ["serve", "--client-ca", "ca.pem", "--allowed-san", "spiffe://a/b, gw.example,"]
    argv += ["--token-file", "tokens", "--insecure-no-auth"]
    namespace = build_parser().parse_args(argv)
    auth = load_settings(overrides=overrides_from(namespace), config_file=None).auth
    assert auth.client_ca_file == Path("ca.pem")
    assert auth.allowed_sans == ("spiffe://a/b", "gw.example")
    assert (auth.token_file, auth.insecure_no_auth) == (Path("tokens"), True)


def test_start_up_refuses_0rtt_with_mtls(tmp_path: Path) -> None:
    settings = production_settings(tmp_path, client_ca_file="ca.pem").model_copy(
        update={"security": Settings().security.model_copy(update={"enable_0rtt": True})}
    )

    async def scenario() -> None:
        with pytest.raises(StartupError, match="cannot be combined with --client-ca"):
            await start_pylon(settings)

    run(scenario())


def test_insecure_no_auth_starts_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        pylon = await start_pylon(production_settings(tmp_path, insecure_no_auth=True))
        await pylon.close()

    with caplog.at_level(logging.WARNING, logger="pylon.auth"):
        run(scenario())
    assert any("INSECURE" in record.getMessage() for record in caplog.records)
