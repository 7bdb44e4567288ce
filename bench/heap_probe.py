"""`python -m bench.heap_probe DUMP_DIR serve ...`: `pylon` under tracemalloc, dumped on SIGUSR2.

Strategy: tracemalloc starts before Pylon is imported, so every block Pylon
allocates is traced. Each SIGUSR2 (the soak sends one after each window,
when the window's streams have finished) collects garbage and writes
`DUMP_DIR/heap-<n>.json`: the traced bytes, and the source lines whose live
blocks grew most since the first dump. The handler runs on the main thread
between bytecodes, so the snapshot sees a consistent heap. This answers what
RSS cannot: whether Python objects accumulate, or only the allocator's pages.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import tracemalloc
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

GROWTH_SITES = 15
"""Source lines listed per dump, largest growth first."""

_UNTRACED = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))


def dump_path(dump_dir: Path, index: int) -> Path:
    return dump_dir / f"heap-{index}.json"


def short_site(filename: str, lineno: int) -> str:
    """`package/module.py:LINE`: the part after site-packages or the Python library."""
    for marker in ("site-packages/", "/lib/python3"):
        _, found, tail = filename.rpartition(marker)
        if found:
            filename = tail if marker == "site-packages/" else "python3" + tail
            break
    else:
        filename = os.path.relpath(filename) if os.path.isabs(filename) else filename
    return f"{filename}:{lineno}"


def growth_rows(stats: Iterable[tracemalloc.StatisticDiff], limit: int) -> list[dict[str, Any]]:
    """The `limit` sites whose live bytes grew most (shrinking sites are not growth)."""
    grown = sorted((s for s in stats if s.size_diff > 0), key=lambda s: -s.size_diff)
    return [
        {
            "site": short_site(s.traceback[0].filename, s.traceback[0].lineno),
            "size_diff_bytes": s.size_diff,
            "count_diff": s.count_diff,
        }
        for s in grown[:limit]
    ]


class HeapProbe:
    def __init__(self, dump_dir: Path) -> None:
        self._dump_dir = dump_dir
        self._first: tracemalloc.Snapshot | None = None
        self._dumps = 0

    def on_signal(self, _signum: int, _frame: object) -> None:
        self.dump()

    def dump(self) -> Path:
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(_UNTRACED)
        first = self._first = self._first or snapshot
        self._dumps += 1
        report = {
            "dump": self._dumps,
            "traced_bytes": sum(trace.size for trace in snapshot.traces),
            "growth_since_first": growth_rows(snapshot.compare_to(first, "lineno"), GROWTH_SITES),
        }
        path = dump_path(self._dump_dir, self._dumps)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(report, indent=1))
        partial.rename(path)  # a reader never sees half a dump
        return path


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m bench.heap_probe DUMP_DIR serve [pylon serve args]")
        return 2
    dump_dir = Path(argv[0])
    dump_dir.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(1)
    probe = HeapProbe(dump_dir)
    signal.signal(signal.SIGUSR2, probe.on_signal)
    from pylon.cli import main as pylon_main

    return pylon_main(list(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
