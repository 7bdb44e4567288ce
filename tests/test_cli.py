"""The command line: flags map to settings, bad input is one readable line, and the
README's main job (`pylon serve --dev` then `pylon call`) works as real processes."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pylon.app import StartupError
from pylon.cli import SERVE_FLAGS, build_parser, overrides_from, run_event_loop
from pylon.config import Settings, load_settings

PYLON = [sys.executable, "-m", "pylon.cli"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PYLON_"):
            monkeypatch.delenv(name)


def _settings(*argv: str) -> Settings:
    namespace = build_parser().parse_args(["serve", *argv])
    return load_settings(overrides=overrides_from(namespace), config_file=namespace.config)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], True),
        (["--derive-priority"], True),
        (["--derive-priority=false"], False),
        (["--derive-priority", "false"], False),
        (["--derive-priority=true"], True),
        (["--no-derive-priority"], False),
    ],
)
def test_kill_switch_flag_forms(argv: list[str], expected: bool) -> None:
    assert _settings(*argv).derive_priority is expected


def test_kill_switch_env_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYLON_DERIVE_PRIORITY", "false")
    assert _settings().derive_priority is False
    assert _settings("--derive-priority").derive_priority is True, "a flag beats the environment"


def test_flags_reach_nested_settings() -> None:
    settings = _settings(
        "--upstream",
        "http://127.0.0.1:8000/",
        "--backend",
        "sglang",
        "--sglang-scale",
        "20",
        "--priority-ceiling",
        "50",
        "--idle-timeout-s",
        "9",
    )
    assert settings.upstream.url == "http://127.0.0.1:8000"
    assert settings.backend.type == "sglang"
    assert settings.backend.scale == 20  # type: ignore[union-attr]
    assert settings.priority.ceiling == 50
    assert settings.upstream.idle_timeout_s == 9


def test_dynamo_strict_tier_bands_flag() -> None:
    settings = _settings("--backend", "dynamo", "--dynamo-strict-tier-bands", "9:2, 99:1")
    bands = settings.backend.strict_tier_bands  # type: ignore[union-attr]
    assert [(b.max_level, b.tier) for b in bands] == [(9, 2), (99, 1)]
    with pytest.raises(SystemExit):
        _settings("--backend", "dynamo", "--dynamo-strict-tier-bands", "9-2")


def test_every_flag_names_a_real_setting() -> None:
    for flag in SERVE_FLAGS:
        section, _, leaf = flag.key.rpartition(".")
        model: type = Settings
        if section == "backend":
            continue  # backend keys depend on backend.type; covered by test_flags_reach_nested
        if section:
            model = Settings.model_fields[section].annotation  # type: ignore[assignment]
        assert leaf in model.model_fields, flag.flag


def test_config_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "pylon.toml"
    config.write_text(
        'listen = "0.0.0.0:5000"\n[upstream]\nurl = "http://a:1"\nidle_timeout_s = 7\n'
    )
    monkeypatch.setenv("PYLON_UPSTREAM__URL", "http://b:2")
    settings = _settings("--config", str(config), "--listen", "127.0.0.1:6000")
    assert settings.listen == "127.0.0.1:6000"
    assert settings.upstream.url == "http://b:2"
    assert settings.upstream.idle_timeout_s == 7


def test_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "pylon.toml"
    config.write_text("[upstream]\nurl = 'http://a:1'\nidle_timout_s = 7\n")
    with pytest.raises(ValidationError):
        _settings("--config", str(config))


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_event_loop_is_uvloop_when_installed() -> None:
    assert run_event_loop(_loop_module(), choice="auto").startswith("uvloop")
    assert run_event_loop(_loop_module(), choice="asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails
    assert run_event_loop(_loop_module(), choice="auto").startswith("asyncio")
    with pytest.raises(StartupError, match="uvloop is not installed"):
        run_event_loop(_loop_module(), choice="uvloop")


def _pylon(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PYLON, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["serve"], ["mock-engine"], ["call"]])
def test_help(command: list[str]) -> None:
    result = _pylon(*command, "--help")
    assert result.returncode == 0
    assert "usage: pylon" in result.stdout


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (
            ["serve", "--upstream", "ftp://x"],
            r"^pylon: invalid setting upstream\.url: .*must start",
        ),
        (["serve", "--listen", "nowhere"], r"^pylon: invalid setting listen: .*HOST:PORT"),
        (["serve", "--backend", "tgi"], r"^pylon: invalid setting backend: "),
        (["serve", "--config", "/nonexistent.toml"], r"^pylon: config file .* not found"),
        (["serve", "--upstream", "http://127.0.0.1:1"], r"^pylon: a TLS certificate and key"),
    ],
)
def test_bad_input_exits_with_one_readable_line(argv: list[str], pattern: str) -> None:
    result = _pylon(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.search(pattern, lines[0]), lines[0]


def test_unknown_flag_exits_non_zero() -> None:
    result = _pylon("serve", "--frobnicate")
    assert result.returncode == 2
    assert "unrecognized arguments: --frobnicate" in result.stderr


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_serve_dev_and_call_stream_a_chat_completion(tmp_path: Path, event_loop: str) -> None:
    """The README's main job: `pylon serve --dev` in front of the mock, `pylon call` through it."""
    with subprocess.Popen(
        [
            *PYLON,
            "serve",
            "--dev",
            "--event-loop",
            event_loop,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        _exercise(server, tmp_path)
    assert server.returncode == 0


def _exercise(server: subprocess.Popen[str], tmp_path: Path) -> None:
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()
        match = re.search(r"tunnel on 127\.0\.0\.1:(\d+)", ready)
        assert match, ready
        hint = "".join(server.stdout.readline() for _ in range(5))
        assert "pylon call https://localhost:" in hint
        body = '{"model":"mock-model","stream":true,"messages":[{"role":"user","content":"hi"}]}'
        result = _pylon(
            "call",
            f"https://localhost:{match.group(1)}/v1/chat/completions",
            "--cacert",
            str(tmp_path / "state" / "dev-cert.pem"),
            "-H",
            "x-request-id: cli-1",
            "-H",
            "x-priority: 5",
            "-d",
            body,
        )
        assert result.returncode == 0, result.stderr
        assert "HTTP/3 200" in result.stderr
        assert result.stdout.count("data: ") > 2
        assert result.stdout.rstrip().endswith("data: [DONE]")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_call_presents_a_client_certificate_to_an_mtls_pylon(tmp_path: Path) -> None:
    """`pylon serve --client-ca` admits `pylon call --cert/--key`, and refuses it without them."""
    from pylon.devcert import ensure_dev_certificate
    from tests.security_kit import make_pki

    pki = make_pki(tmp_path / "pki")
    cert, key = ensure_dev_certificate(tmp_path / "server")
    argv = [
        *PYLON,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--cert",
        str(cert),
        "--key",
        str(key),
        "--client-ca",
        str(pki.ca_file),
        "--upstream",
        "http://127.0.0.1:9",
    ]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as server:
        try:
            assert server.stdout is not None
            match = re.search(r"tunnel on 127\.0\.0\.1:(\d+)", server.stdout.readline())
            assert match
            url = f"https://localhost:{match.group(1)}/health"
            client_cert, client_key = pki.client
            admitted = _pylon(
                "call",
                url,
                "--cacert",
                str(cert),
                "--cert",
                str(client_cert),
                "--key",
                str(client_key),
            )
            # The engine is down: a 502 from Pylon proves the request got through the handshake.
            assert "HTTP/3 502" in admitted.stderr, admitted.stderr
            refused = _pylon("call", url, "--cacert", str(cert))
            assert refused.returncode == 2
            assert "no response, closed by the server" in refused.stderr
            assert "HTTP/3" not in refused.stderr
        finally:
            server.terminate()
            server.wait(timeout=30)
