"""Where results go: `bench/results/<timestamp>/` with JSON, logs and (optional) PNG plots.

matplotlib is an optional extra (`pip install -e '.[bench]'`): without it
the bench still writes every JSON file and says which plots it skipped.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.procfs import background_busy_cores, process_tree
from bench.progress import note
from bench.stats import percentile

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
CDF_POINTS = 200


def results_dir(root: Path | None = None, *, name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = (root or RESULTS_ROOT) / f"{stamp}-{name}"
    path.mkdir(parents=True, exist_ok=False)
    return path


BUSY_WARNING_CORES = 0.2


def machine() -> dict[str, Any]:
    """The machine, and how busy other work kept it just before the bench started."""
    busy = background_busy_cores()
    if busy > BUSY_WARNING_CORES:
        note(f"warning: other work keeps {busy:.1f} of {os.cpu_count()} cores busy: noisy results")
    return {
        "cpus": os.cpu_count(),
        "background_busy_cores": round(busy, 2),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "caddy": _version(["caddy", "version"]),
    }


BUILD_FLAGS = ("--enable-optimizations", "--with-lto")
"""The configure flags that change how fast the interpreter runs Python: PGO and LTO."""

_DESCRIBE_INTERPRETER = (
    "import json, sys, sysconfig; print(json.dumps({'version': sys.version.split()[0],"
    " 'config_args': sysconfig.get_config_var('CONFIG_ARGS') or ''}))"
)


def build_flags(config_args: str) -> list[str]:
    """Which of BUILD_FLAGS an interpreter's recorded configure arguments hold."""
    recorded = {arg.strip("'\"").split("=")[0] for arg in config_args.split()}
    return [flag for flag in BUILD_FLAGS if flag in recorded]


def maps_libpython(maps: str) -> bool:
    """Whether a process's memory map (/proc/<pid>/maps) holds a shared libpython,
    which costs the interpreter's own calls an indirection. The map, not the
    configure arguments: Debian records `--enable-shared` for a static binary."""
    for line in maps.splitlines():
        fields = line.split()  # six or more when a file is mapped, its path last
        if len(fields) >= 6 and os.path.basename(fields[-1]).startswith("libpython"):
            return True
    return False


def interpreter(pid: int) -> dict[str, Any] | None:
    """The Python that runs process `pid` (or the first Python below it, behind a
    launcher): its executable, version and build flags. Figures for Pylon depend on
    the build as much as on Pylon (docs/performance.md, "The interpreter").

    Some distributions build with PGO and LTO but record other configure
    arguments (Debian's static interpreter), so no flag is not proof of none.
    """
    for member in process_tree(pid):
        exe = os.path.realpath(f"/proc/{member}/exe")
        if not os.path.basename(exe).startswith("python"):
            continue
        try:
            shared = maps_libpython(Path(f"/proc/{member}/maps").read_text())
            done = subprocess.run(
                [exe, "-c", _DESCRIBE_INTERPRETER],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            described = json.loads(done.stdout)
        except (OSError, subprocess.SubprocessError, ValueError):
            return {"executable": exe}
        return {
            "executable": exe,
            "version": described["version"],
            "build_flags": build_flags(described["config_args"]),
            "shared_libpython": shared,
        }
    return None


def _version(argv: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return None
    return done.stdout.strip().split()[0] if done.stdout.strip() else None


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def cdf(values: Sequence[float], points: int = CDF_POINTS) -> tuple[list[float], list[float]]:
    """(x, y) of an empirical CDF at `points` evenly spaced quantiles (pure)."""
    if not values:
        return [], []
    qs = [100 * i / (points - 1) for i in range(points)]
    xs = [percentile(values, q) or 0.0 for q in qs]
    return xs, [q / 100 for q in qs]


def plot(
    path: Path, draw: Callable[[Any], None], *, size: tuple[float, float] = (8, 5)
) -> Path | None:
    """Call `draw(pyplot)` and save a PNG, or say why not (matplotlib missing)."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        pyplot: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        note(f"matplotlib not installed: skipped {path.name} (pip install -e '.[bench]')")
        return None
    figure = pyplot.figure(figsize=size)
    try:
        draw(pyplot)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    finally:
        pyplot.close(figure)
    return path
