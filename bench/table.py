"""Pure text formatting: fixed-width tables and unit-aware numbers for stdout.

Strategy: callers build rows of already-chosen cells (strings); `fmt_*`
helpers turn numbers (or None, shown as "-") into those cells, so the table
code never guesses units.
"""

from __future__ import annotations

from collections.abc import Sequence

MISSING = "-"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned numbers, one space-padded line per row."""
    widths = [len(h) for h in headers]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, expected {len(headers)}")
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [_line(headers, widths), _line(["-" * w for w in widths], widths)]
    lines += [_line(row, widths) for row in rows]
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    first, *rest = cells
    parts = [first.ljust(widths[0])]
    parts += [cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True)]
    return "  ".join(parts).rstrip()


def fmt_ms(seconds: float | None, digits: int = 2) -> str:
    return MISSING if seconds is None else f"{seconds * 1000:.{digits}f}"


def fmt_us(seconds: float | None) -> str:
    return MISSING if seconds is None else f"{seconds * 1e6:.0f}"


def fmt_num(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return MISSING
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return MISSING if value is None else f"{value:.2f}x"


def fmt_mib(value_bytes: float | int | None) -> str:
    return MISSING if value_bytes is None else f"{value_bytes / (1 << 20):.1f}"
