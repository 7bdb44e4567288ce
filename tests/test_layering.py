"""The dependency direction, read from the imports: pylon -> (tunnel, backends), never back;
tunnel knows no engines; only pylon loads settings or declares metrics."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        (
            "tunnel",
            {"pylon", "backends", "httpx", "pydantic", "pydantic_settings", "prometheus_client"},
        ),
        ("backends", {"pylon", "tunnel", "pydantic_settings", "prometheus_client"}),
    ],
)
def test_lower_layers_do_not_import_upward(package: str, forbidden: set[str]) -> None:
    offenders = {
        module: sorted(names & forbidden)
        for module, names in imported_modules(package).items()
        if names & forbidden
    }
    assert offenders == {}


def test_packages_declare_their_public_surface() -> None:
    for package in ("pylon", "tunnel", "backends"):
        tree = ast.parse((ROOT / package / "__init__.py").read_text())
        declared = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        assert declared, f"{package}/__init__.py has no __all__"
