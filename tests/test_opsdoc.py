"""pylon.opsdoc: the generated settings table covers every setting and flag, and
docs/operations.md carries exactly what the code generates today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from backends.config import DynamoConfig, PassthroughConfig, SglangConfig, VllmConfig
from pylon import opsdoc
from pylon.cli import SERVE_FLAGS, Flag, build_parser, overrides_from
from pylon.config import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
OPERATIONS_MD = REPO / "docs" / "operations.md"
BACKEND_CONFIGS: tuple[type[BaseModel], ...] = (
    PassthroughConfig,
    DynamoConfig,
    VllmConfig,
    SglangConfig,
)


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted keys of every non-section field, walked independently of opsdoc."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= _leaf_keys(annotation, f"{prefix}{name}.")
        elif name != "backend" or prefix:
            keys.add(prefix + name)
    return keys


def _expected_keys() -> set[str]:
    backend_keys = {f"backend.{name}" for cls in BACKEND_CONFIGS for name in cls.model_fields}
    return _leaf_keys(Settings) | backend_keys


def test_docs_hold_the_generated_table() -> None:
    document = OPERATIONS_MD.read_text()
    assert document.count(opsdoc.BEGIN_MARKER) == 1
    assert document.count(opsdoc.END_MARKER) == 1
    assert opsdoc.generated_part(document) == opsdoc.generate(), (
        "docs/operations.md is stale: run `python -m pylon.opsdoc --write docs/operations.md`"
    )


def test_every_settings_field_has_a_row() -> None:
    table = opsdoc.generate()
    for key in _expected_keys():
        assert f"| `{key}` |" in table, key


def test_every_env_var_has_a_row() -> None:
    table = opsdoc.generate()
    for key in _expected_keys():
        env = "PYLON_" + key.replace(".", "__").upper()
        assert f"`{env}`" in table, env


@pytest.mark.parametrize("flag", SERVE_FLAGS, ids=lambda flag: flag.flag)
def test_every_serve_flag_appears_on_its_settings_row(flag: Flag) -> None:
    rows = [line for line in opsdoc.generate().splitlines() if f"| `{flag.key}` |" in line]
    assert len(rows) == 1, flag.key
    assert f"`{flag.flag}" in rows[0]
    if flag.boolean:
        assert f"`--no-{flag.flag[2:]}`" in rows[0]


def test_rows_keep_defaults_and_env_names() -> None:
    rows = {row.key: row for row in opsdoc.settings_rows()}
    assert rows["admin_listen"].default == "`127.0.0.1:9464`"
    assert rows["upstream.url"].default == "unset"
    assert rows["derive_priority"].default == "`true`"
    assert rows["limits.max_body_bytes"].default == "`33554432` (32 MiB)"
    assert rows["priority.absent"].default == "`lowest`"
    assert rows["tls.cert_file"].env == "PYLON_TLS__CERT_FILE"
    assert rows["backend.scale"].backend == "sglang"
    assert rows["backend.type"].backend is None
    assert rows["backend.type"].type == "one of passthrough, dynamo, vllm, sglang"


def test_a_flag_for_an_unknown_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(opsdoc, "SERVE_FLAGS", (*SERVE_FLAGS, Flag("--bogus", "no.such", "x")))
    with pytest.raises(ValueError, match=r"no\.such"):
        opsdoc.generate()


def test_replace_generated_round_trips() -> None:
    document = f"intro\n{opsdoc.BEGIN_MARKER}\nold table\n{opsdoc.END_MARKER}\noutro\n"
    updated = opsdoc.replace_generated(document, "new table\n")
    assert opsdoc.generated_part(updated) == "new table\n"
    assert updated.startswith("intro\n") and updated.endswith(f"{opsdoc.END_MARKER}\noutro\n")


def test_module_prints_the_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pylon.opsdoc"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.stdout == opsdoc.generate()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [n for n in os.environ if n.startswith("PYLON_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("flag", ["--no-derive-priority", "--derive-priority=false"])
def test_documented_kill_switch_flags_work(flag: str, clean_env: pytest.MonkeyPatch) -> None:
    assert f"`{flag}`" in OPERATIONS_MD.read_text()
    namespace = build_parser().parse_args(["serve", flag])
    settings = load_settings(overrides=overrides_from(namespace), config_file=None)
    assert settings.derive_priority is False


def test_documented_kill_switch_env_and_config_work(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    document = OPERATIONS_MD.read_text()
    assert "`PYLON_DERIVE_PRIORITY=false`" in document
    assert "`derive_priority = false`" in document
    config = tmp_path / "pylon.toml"
    config.write_text("derive_priority = false\n")
    assert load_settings(overrides={}, config_file=config).derive_priority is False
    clean_env.setenv("PYLON_DERIVE_PRIORITY", "false")
    assert load_settings(overrides={}, config_file=None).derive_priority is False
