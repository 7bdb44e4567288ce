"""The operator's table of every setting: config key, env var, flag, default.

Strategy: everything is read from the code, nothing is typed twice. The rows
come from walking `Settings` (nested sections become dotted keys; the
discriminated `backend` section gets one table per backend config class), the
flag spellings from `SERVE_FLAGS`, the meanings from each field's attribute
docstring (or the flag's help when the field has none). `docs/operations.md`
holds the output between two markers and a test compares them, so the docs
cannot drift from the code.

    python -m pylon.opsdoc                          # print the table
    python -m pylon.opsdoc --write docs/operations.md   # refresh the docs
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pylon.cli import SERVE_FLAGS, Flag
from pylon.config import Settings

__all__ = [
    "BEGIN_MARKER",
    "END_MARKER",
    "Row",
    "generate",
    "generated_part",
    "replace_generated",
    "settings_rows",
]

BEGIN_MARKER = "<!-- BEGIN GENERATED -->"
END_MARKER = "<!-- END GENERATED -->"
ENV_PREFIX = "PYLON_"
ENV_DELIMITER = "__"
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    key: str
    """Dotted settings key: `upstream.url` is `[upstream]` `url` in TOML."""
    type: str
    default: str
    meaning: str
    backend: str | None = None
    """The `backend.type` this key belongs to; None for keys every backend has."""

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.replace(".", ENV_DELIMITER).upper()


# --- walking the models ---------------------------------------------------------------


def attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> its attribute docstring (the string literal under it), one line."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        except (OSError, TypeError):
            continue
        assert isinstance(body, ast.ClassDef)
        for target, after in zip(body.body, body.body[1:], strict=False):
            documented = _documented_field(target, after)
            if documented is not None:
                docs[documented[0]] = documented[1]
    return docs


def _documented_field(target: ast.stmt, after: ast.stmt) -> tuple[str, str] | None:
    if not (isinstance(target, ast.AnnAssign) and isinstance(target.target, ast.Name)):
        return None
    if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
        return None
    return target.target.id, " ".join(str(after.value.value).split())


def _model_union(annotation: Any) -> tuple[type[BaseModel], ...] | None:
    """The member classes when `annotation` is a (discriminated) union of models."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) not in (Union, types.UnionType):
        return None
    members = get_args(annotation)
    if all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return members
    return None


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tag(model: type[BaseModel]) -> str:
    return str(model.model_fields["type"].default)


def _leaf_rows(model: type[BaseModel], prefix: str, *, backend: str | None = None) -> Iterator[Row]:
    docs = attribute_docs(model)
    for name, field in model.model_fields.items():
        key = prefix + name
        union = _model_union(field.annotation)
        if _is_model(field.annotation):
            yield from _leaf_rows(field.annotation, key + ".", backend=backend)  # type: ignore[arg-type]
        elif union is not None:
            yield _discriminator_row(key, union, docs.get(name, ""))
            for member in union:
                yield from _member_rows(member, key + ".")
        else:
            yield Row(
                key, type_name(field.annotation), _default(field), docs.get(name, ""), backend
            )


def _discriminator_row(key: str, members: Sequence[type[BaseModel]], doc: str) -> Row:
    tags = [_tag(m) for m in members]
    meaning = doc or "Selects the engine adapter; its own keys are in the next table."
    return Row(key + ".type", "one of " + ", ".join(tags), f"`{tags[0]}`", meaning)


def _member_rows(member: type[BaseModel], prefix: str) -> Iterator[Row]:
    for row in _leaf_rows(member, prefix, backend=_tag(member)):
        if row.key != prefix + "type":
            yield row


def _backend_tags() -> list[str]:
    union = _model_union(Settings.model_fields["backend"].annotation)
    return [_tag(member) for member in union or ()]


def settings_rows() -> list[Row]:
    """One row per settings key, shared keys first, in declaration order."""
    rows = list(_leaf_rows(Settings, ""))
    return [r for r in rows if r.backend is None] + [r for r in rows if r.backend is not None]


# --- rendering values -----------------------------------------------------------------


def type_name(annotation: Any) -> str:
    args = [a for a in get_args(annotation) if a is not type(None)]
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is tuple:
        item = args[0]
        inner = (
            "{" + ", ".join(item.model_fields) + "}" if _is_model(item) else type_name(item) + "s"
        )
        return f"list of {inner} (JSON in env)"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(str(m.value) for m in annotation)
    simple = {str: "string", int: "integer", float: "number", bool: "bool", Path: "path"}
    return simple.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Enum):
        return f"`{value.value}`"
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    if isinstance(value, int) and value >= MIB and value % MIB == 0:
        return f"`{value}` ({value // MIB} MiB)"
    return f"`{value}`"


def _flag_cell(flag: Flag | None) -> str:
    if flag is None:
        return ""
    if flag.boolean:
        return f"`{flag.flag}[=BOOL]`, `--no-{flag.flag[2:]}`"
    return f"`{flag.flag} {flag.metavar}`" if flag.metavar else f"`{flag.flag}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# --- the document ---------------------------------------------------------------------

_PREAMBLE = (
    "Precedence, highest first: flag, environment variable, config file "
    "(`--config FILE`, TOML), default. A dotted key `section.name` is `name` under "
    "`[section]` in the config file. Unknown keys are errors everywhere."
)


def generate() -> str:
    """The markdown that belongs between the markers in docs/operations.md."""
    rows = settings_rows()
    flags = {flag.key: flag for flag in SERVE_FLAGS}
    unknown = sorted(set(flags) - {row.key for row in rows})
    if unknown:
        raise ValueError(f"SERVE_FLAGS name keys that are not settings: {unknown}")
    shared = [r for r in rows if r.backend is None]
    specific = [r for r in rows if r.backend is not None]
    plain = [t for t in _backend_tags() if t not in {r.backend for r in specific}]
    head = "| Key | Environment variable | Flag | Type | Default | Meaning |"
    lines = [_PREAMBLE, "", head, "| --- | --- | --- | --- | --- | --- |"]
    lines += [_line(r, flags.get(r.key)) for r in shared]
    lines += ["", "Backend-specific keys (valid only with the matching `backend.type`; "]
    lines[-1] += ", ".join(f"`{t}`" for t in plain) + " have none of their own):"
    lines += [""]
    lines += ["| Backend " + head, "| --- " + "| --- " * 6 + "|"]
    lines += [f"| {r.backend} " + _line(r, flags.get(r.key)) for r in specific]
    return "\n".join(lines) + "\n"


def _line(row: Row, flag: Flag | None) -> str:
    meaning = row.meaning or (flag.help if flag else "")
    cells = [f"`{row.key}`", f"`{row.env}`", _flag_cell(flag), row.type, row.default, meaning]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def replace_generated(document: str, generated: str) -> str:
    """`document` with the text between the markers replaced by `generated`."""
    start = document.index(BEGIN_MARKER) + len(BEGIN_MARKER)
    end = document.index(END_MARKER, start)
    return document[:start] + "\n" + generated + "\n" + document[end:]


def generated_part(document: str) -> str:
    """The text between the markers, as `generate()` wrote it."""
    start = document.index(BEGIN_MARKER) + len(BEGIN_MARKER)
    return document[start : document.index(END_MARKER, start)].strip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pylon.opsdoc", description=__doc__)
    parser.add_argument("--write", type=Path, metavar="FILE", help="replace between markers")
    args = parser.parse_args(argv)
    table = generate()
    if args.write is None:
        sys.stdout.write(table)
        return 0
    args.write.write_text(replace_generated(args.write.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
