"""`python -m bench priority`: per-class queue wait and TTFT under overload, two policies.

Strategy: for each backend, a mock engine of that flavour with `--slots`
(so it has a real queue, ordered by the engine's own rule) and Pylon in
front with the matching `--backend`. The offered load is a mix of priority
classes plus unconfigured traffic (no x-priority), open loop, at
`sum(shares)` times the engine's capacity (slots / (tokens x token delay)).
Each backend runs twice: `--priority-ceiling 1000` (Pylon as is) and
`--priority-ceiling 2147483647`, which reproduces the i32::MAX anchor the
design review rejected. Queue wait comes from the engine's /test-control
records, TTFT from the client; requests still waiting when the run ends are
abandoned and count as starved.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import stack
from bench.drivers import Target
from bench.load import LoadSpec, run_load
from bench.output import machine, results_dir, write_json
from bench.plots import priority_plot
from bench.progress import note
from bench.queueing import class_stats, priority_table
from bench.workloads import PriorityClass, parse_classes, priority, with_headers
from pylon.devcert import ensure_dev_certificate

BACKENDS = ("dynamo", "vllm", "sglang")
I32_MAX = 2**31 - 1
DEFAULT_CEILINGS = (1000, I32_MAX)
DEFAULT_CLASSES = "0:0.15,500:0.15,990:0.8,none:0.3"
"""1.4x the engine's capacity; the prioritized classes alone (1.1x) already
overload it, so prioritized traffic is always waiting. Class 990 sits 10
levels under the default ceiling: with Dynamo's seconds-of-head-start reading
it is 10 s ahead of unconfigured traffic, short enough to see within a run."""
BACKEND_ARGS = {"sglang": ("--sglang-priority-scheduling",)}
"""The SGLang mock runs with --enable-priority-scheduling; Pylon must be told."""


def policy_name(ceiling: int) -> str:
    return "i32::MAX" if ceiling == I32_MAX else f"ceiling={ceiling}"


@dataclass(frozen=True)
class PriorityOptions:
    backends: tuple[str, ...] = BACKENDS
    ceilings: tuple[int, ...] = DEFAULT_CEILINGS
    classes: tuple[PriorityClass, ...] = field(
        default_factory=lambda: parse_classes(DEFAULT_CLASSES)
    )
    slots: int = 4
    tokens: int = 10
    token_delay_ms: float = 20.0
    duration_s: float = 20.0
    drain_s: float = 5.0
    workers: int = 2
    out_root: Path | None = None

    @property
    def capacity_rps(self) -> float:
        return self.slots / (self.tokens * self.token_delay_ms / 1000)

    @property
    def rate_rps(self) -> float:
        return self.capacity_rps * sum(c.share for c in self.classes)


def run_priority(options: PriorityOptions) -> dict[str, Any]:
    out = results_dir(options.out_root, name="priority")
    note(
        f"results in {out}; engine capacity {options.capacity_rps:.1f} req/s, "
        f"offered {options.rate_rps:.1f} req/s for {options.duration_s:.0f} s"
    )
    host = machine()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tls = ensure_dev_certificate(Path(tmp) / "cert")
        auth = stack.write_token(Path(tmp))
        for backend in options.backends:
            for ceiling in options.ceilings:
                runs.append(_one_run(options, out, backend, ceiling, tls=tls, auth=auth))
    return _report(options, out, runs, host)


def _one_run(
    options: PriorityOptions,
    out: Path,
    backend: str,
    ceiling: int,
    *,
    tls: tuple[Path, Path],
    auth: tuple[Path, tuple[str, str]],
) -> dict[str, Any]:
    policy = policy_name(ceiling)
    extra = ("--priority-ceiling", str(ceiling), *BACKEND_ARGS.get(backend, ()))
    with (
        stack.engine(
            out,
            flavour=backend,
            slots=options.slots,
            tokens=options.tokens,
            token_delay_ms=options.token_delay_ms,
        ) as engine,
        stack.pylon(
            out,
            upstream=engine.url,
            cert=tls[0],
            key=tls[1],
            token_file=auth[0],
            backend=backend,
            extra_args=extra,
        ) as pylon,
    ):
        spec = LoadSpec(
            target=Target("h3", stack.HOST, pylon.port),
            pattern=with_headers(priority(options.classes, tokens=options.tokens), [auth[1]]),
            requests=math.ceil(options.rate_rps * options.duration_s),
            rate_rps=options.rate_rps,
            duration_s=options.duration_s,
            drain_s=options.drain_s,
            workers=options.workers,
            run_id=f"{backend}-{ceiling}",
        )
        result = run_load(spec, label=f"{backend} {policy}")
        snapshot = stack.engine_snapshot(engine.url)
    labels = [c.label for c in options.classes]
    rows = class_stats(result.records, snapshot["requests"], labels)
    return {"backend": backend, "policy": policy, "ceiling": ceiling, "classes": rows}


def _report(
    options: PriorityOptions, out: Path, runs: list[dict[str, Any]], host: dict[str, Any]
) -> dict[str, Any]:
    options_json = asdict(options) | {"out_root": str(options.out_root or "")}
    result = {
        "command": ["python", "-m", "bench", *sys.argv[1:]],
        "options": options_json,
        "capacity_rps": options.capacity_rps,
        "offered_rps": options.rate_rps,
        "machine": host,
        "runs": runs,
    }
    write_json(out / "priority.json", result)
    print("\n== priority: per-class queue wait and TTFT under overload ==")
    print(priority_table(runs))
    priority_plot(
        out,
        backends=options.backends,
        classes=options.classes,
        runs=runs,
        cap_s=options.duration_s + options.drain_s,
    )
    print(f"\nresults: {out}")
    return result
