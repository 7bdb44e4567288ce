"""docs/gateway-contract.md agrees with the adapters' tables, both directions.

The document's per-backend tables (headers, body fields, routes) are parsed
and compared with each adapter's deny-lists, derived names, body fields and
routes; `drift` lists every disagreement, so a change to either side without
the other fails here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from backends import (
    BACKEND_TYPES,
    BackendAdapter,
    BackendConfig,
    DynamoAdapter,
    DynamoConfig,
    PriorityPolicy,
    RouteClass,
    SglangAdapter,
    VllmAdapter,
    build_adapter,
    strip_headers,
)
from backends.base import dotted, prefix_pattern
from backends.config import PassthroughConfig, SglangConfig, VllmConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "gateway-contract.md"
SECTION = re.compile(r"^## Backend: `([a-z0-9_]+)`\s*$")
HEADER_RULES = {"stripped", "derived", "forwarded"}
BODY_RULES = {"removed", "set"}


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[dict[str, str], ...]


@dataclass
class Section:
    tables: dict[str, Table]
    """Keyed by the first column's name: "header", "body field", "method"."""


def _cells(line: str) -> list[str]:
    return [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> Table:
    columns = tuple(_cells(lines[0]))
    rows = tuple(dict(zip(columns, _cells(line), strict=True)) for line in lines[2:])
    return Table(columns=columns, rows=rows)


def parse_backend_sections(text: str) -> dict[str, Section]:
    """Every `## Backend: `name`` section and the tables in it."""
    sections: dict[str, Section] = {}
    current: Section | None = None
    pending: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            pending.append(line)
            continue
        if pending and current is not None:
            table = _table(pending)
            assert table.columns[0] not in current.tables, f"two {table.columns[0]!r} tables"
            current.tables[table.columns[0]] = table
        pending = []
        if line.startswith("## "):
            match = SECTION.match(line)
            current = sections.setdefault(match.group(1), Section({})) if match else None
    return sections


def _by_rule(table: Table, key: str, rule: str) -> set[str]:
    return {row[key] for row in table.rows if row["rule"] == rule}


def header_drift(adapter: BackendAdapter, table: Table) -> list[str]:
    problems = [
        f"bad rule {r['rule']!r} for {r['header']}"
        for r in table.rows
        if r["rule"] not in HEADER_RULES
    ]
    names = [row["header"] for row in table.rows]
    problems += [f"listed twice: {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    stripped = set(adapter.all_denied_headers()) | {
        prefix_pattern(p) for p in adapter.all_denied_header_prefixes()
    }
    problems += _compare("stripped header", stripped, _by_rule(table, "header", "stripped"))
    derived = set(adapter.derived_header_names())
    problems += _compare("derived header", derived, _by_rule(table, "header", "derived"))
    for name in sorted(_by_rule(table, "header", "forwarded")):
        if not strip_headers(adapter, [(name.encode(), b"1")]).headers:
            problems.append(f"documented as forwarded but stripped: {name}")
    return problems


def body_drift(adapter: BackendAdapter, table: Table) -> list[str]:
    problems = [
        f"bad rule {r['rule']!r} for {r['body field']}"
        for r in table.rows
        if r["rule"] not in BODY_RULES
    ]
    derived = {dotted(path) for path in adapter.derived_body_fields}
    removed = {dotted(path) for path in adapter.all_denied_body_fields()} - derived
    problems += _compare("removed body field", removed, _by_rule(table, "body field", "removed"))
    problems += _compare("set body field", derived, _by_rule(table, "body field", "set"))
    return problems


def route_drift(adapter: BackendAdapter, table: Table) -> list[str]:
    documented = {(row["method"], row["path"]): row["class"] for row in table.rows}
    actual = {route: str(route_class) for route, route_class in adapter.routes.items()}
    code = {f"{m} {p} {c}" for (m, p), c in actual.items()}
    doc = {f"{m} {p} {c}" for (m, p), c in documented.items()}
    return _compare("route", code, doc)


def _compare(what: str, code: set[str], doc: set[str]) -> list[str]:
    return [f"{what} in code, not in the doc: {name}" for name in sorted(code - doc)] + [
        f"{what} in the doc, not in code: {name}" for name in sorted(doc - code)
    ]


def drift(adapter: BackendAdapter, section: Section) -> list[str]:
    missing = {"header", "body field", "method"} - set(section.tables)
    if missing:
        return [f"missing tables: {sorted(missing)}"]
    return (
        header_drift(adapter, section.tables["header"])
        + body_drift(adapter, section.tables["body field"])
        + route_drift(adapter, section.tables["method"])
    )


@pytest.fixture(scope="module")
def sections() -> dict[str, Section]:
    return parse_backend_sections(DOC.read_text(encoding="utf-8"))


CONFIGS: dict[str, BackendConfig] = {
    "passthrough": PassthroughConfig(),
    "dynamo": DynamoConfig(),
    "vllm": VllmConfig(),
    "sglang": SglangConfig(priority_scheduling=True),
}


def test_every_backend_has_a_section(sections: dict[str, Section]) -> None:
    assert set(sections) == set(BACKEND_TYPES) == set(CONFIGS)


@pytest.mark.parametrize("backend", BACKEND_TYPES)
def test_doc_matches_adapter(sections: dict[str, Section], backend: str) -> None:
    adapter = build_adapter(CONFIGS[backend], PriorityPolicy())
    assert drift(adapter, sections[backend]) == []


class _ExtraDeniedHeader(DynamoAdapter):
    denied_headers: ClassVar[frozenset[str]] = DynamoAdapter.denied_headers | {"x-new-pin"}


class _MissingBodyField(VllmAdapter):
    denied_body_fields = VllmAdapter.denied_body_fields[1:]


class _ExtraRoute(SglangAdapter):
    routes = {**SglangAdapter.routes, ("POST", "/flush_cache"): RouteClass.INFERENCE}


class _NowStripsForwarded(DynamoAdapter):
    denied_header_prefixes = ("x-dynamo-",)


@pytest.mark.parametrize(
    ("adapter", "backend", "expected"),
    [
        (_ExtraDeniedHeader(), "dynamo", "stripped header in code, not in the doc: x-new-pin"),
        (_MissingBodyField(), "vllm", "removed body field in the doc, not in code: request_id"),
        (_ExtraRoute(), "sglang", "route in code, not in the doc: POST /flush_cache inference"),
        (_NowStripsForwarded(), "dynamo", "documented as forwarded but stripped: x-dynamo-nvext"),
    ],
)
def test_drift_is_detected(
    sections: dict[str, Section], adapter: BackendAdapter, backend: str, expected: str
) -> None:
    assert expected in drift(adapter, sections[backend])


def test_parser_reads_tables_and_sections() -> None:
    text = "\n".join(
        [
            "## Backend: `x`",
            "| header | rule |",
            "| --- | --- |",
            "| `a-b` | stripped |",
            "",
            "## Other",
            "| header | rule |",
            "| --- | --- |",
            "| c | forwarded |",
        ]
    )
    sections = parse_backend_sections(text)
    assert list(sections) == ["x"]
    assert sections["x"].tables["header"].rows == ({"header": "a-b", "rule": "stripped"},)


@pytest.mark.parametrize(
    "needle",
    [
        "--derive-priority=false",
        "--no-derive-priority",
        "PYLON_DERIVE_PRIORITY=false",
        "--backend TYPE",
        "PYLON_BACKEND__TYPE",
        "--priority-ceiling",
        "PYLON_PRIORITY__CEILING",
        "--priority-absent lowest",
        "PYLON_PRIORITY__ABSENT",
        "--dynamo-strict-priority",
        "PYLON_BACKEND__STRICT_PRIORITY",
        "--sglang-priority-scheduling",
        "PYLON_BACKEND__PRIORITY_SCHEDULING",
        "--sglang-low-values-first",
        "PYLON_BACKEND__LOW_VALUES_FIRST",
        "--sglang-scale",
        "PYLON_BACKEND__SCALE",
        "x-stargate-expected-queue-ms",
    ],
)
def test_operator_flags_are_documented(needle: str) -> None:
    assert needle in DOC.read_text(encoding="utf-8")
