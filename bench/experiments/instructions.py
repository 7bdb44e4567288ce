"""Instructions per small request, counted by callgrind: a figure the machine's load cannot move.

CPU seconds per request on this shared 2-core VM move by a fifth from run to
run (docs/performance.md), which hides a change of a few per cent. Callgrind
(valgrind) counts the instructions a process executes in user space; for the
same code and the same requests the count repeats whatever else the machine
is doing, so two versions of Pylon can be told apart by a per cent.

What it does not see: time in the kernel (system calls; Pylon's are about a
seventh of its CPU one at a time) and how fast the instructions run (cache
misses, the interpreter's branches). It is for A/B of Pylon's own code, not
for a ratio against Caddy.

Each round starts a mock engine and Pylon under `valgrind --tool=callgrind
--instr-atstart=no` (uninstrumented until asked, so start-up is quick), sends
a warm-up load one request at a time (connections, pools, caches), switches
instrumentation on, zeroes the counters once the measured load's client has
connected, sends `--requests` small requests one at a time, and dumps the
counters. Pylon runs 30-100x slower under callgrind, so QUIC's timers fire
more often than at full speed; their share is the same for both versions.
`--candidate-command` adds a second Pylon (a launcher or another checkout,
as in `compare`); rounds alternate which goes first.

Run: python -m bench.experiments.instructions [--requests 200] [--rounds 3]
        [--candidate-command "env -C /tmp/base /path/to/python -m pylon.cli"]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import stack
from bench.drivers import Target
from bench.load import LoadSpec, run_load
from bench.workloads import small, with_headers
from pylon.devcert import ensure_dev_certificate

PYLON_COMMAND = ("python", "-m", "pylon.cli")
UNDER_CALLGRIND_READY_S = 300.0
"""Start-up uninstrumented takes 10-40 s here; an instrumented one several minutes."""
CONTROL_TIMEOUT_S = 120.0
TOTALS = re.compile(rb"^(?:summary|totals): (\d+)", re.MULTILINE)


def valgrind_binary() -> str | None:
    return shutil.which("valgrind")


def callgrind_argv(out_file: Path, command: Sequence[str]) -> list[str]:
    if command and command[0] in ("python", "python3"):
        command = (sys.executable, *command[1:])
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--trace-children=yes",  # through `env -C` and other launchers
        f"--callgrind-out-file={out_file}",
        *command,
    ]


def callgrind_control(option: str, pid: int) -> None:
    subprocess.run(
        ["callgrind_control", option, str(pid)],
        check=True,
        capture_output=True,
        timeout=CONTROL_TIMEOUT_S,
    )


def dumped_instructions(out_dir: Path, prefix: str) -> int:
    """The instruction total of the newest counter dump under `out_dir` named `prefix*`."""
    dumps = sorted(out_dir.glob(f"{prefix}*"), key=lambda path: path.stat().st_mtime_ns)
    if not dumps:
        raise RuntimeError(f"callgrind wrote no dump named {prefix}* in {out_dir}")
    found = TOTALS.search(dumps[-1].read_bytes())
    if found is None:
        raise RuntimeError(f"no instruction total in {dumps[-1]}")
    return int(found.group(1))


@dataclass(frozen=True)
class Count:
    path: str
    requests: int
    instructions: int

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


@contextlib.contextmanager
def _pylon_under_callgrind(
    state: Path, name: str, command: Sequence[str], *, engine: stack.Service, auth: bool
) -> Iterator[tuple[stack.Service, list[tuple[str, str]]]]:
    tls = ensure_dev_certificate(state / "cert")
    token_file, header = stack.write_token(state) if auth else (None, None)
    out_file = state / f"callgrind-{name}.out"
    with stack.pylon(
        state,
        upstream=engine.url,
        cert=tls[0],
        key=tls[1],
        token_file=token_file,
        command=callgrind_argv(out_file, command),
        name=name,
        ready_timeout_s=UNDER_CALLGRIND_READY_S,
    ) as service:
        yield service, [header] if header else []


def count_once(
    name: str, command: Sequence[str], *, requests: int, warmup: int, auth: bool = True
) -> Count:
    """One fresh engine and Pylon; instructions Pylon spent on `requests` small requests."""
    with tempfile.TemporaryDirectory() as tmp, stack.engine(Path(tmp)) as engine:
        state = Path(tmp)
        with _pylon_under_callgrind(state, name, command, engine=engine, auth=auth) as (
            pylon,
            headers,
        ):
            pattern = with_headers(small(), headers)

            def spec(count: int, run_id: str) -> LoadSpec:
                return LoadSpec(
                    target=Target("h3", stack.HOST, pylon.port),
                    pattern=pattern,
                    requests=count,
                    concurrency=1,
                    workers=1,
                    duration_s=3600.0,
                    drain_s=600.0,
                    run_id=run_id,
                )

            run_load(spec(warmup, "warm"), label=f"warm-up {name}")
            callgrind_control("--instr=on", pylon.pid)

            def zero() -> None:
                callgrind_control("--zero", pylon.pid)

            result = run_load(spec(requests, "measured"), label=name, on_start=zero)
            failed = [record for record in result.records if record.error]
            if failed:
                raise RuntimeError(f"{len(failed)} of {requests} requests failed: {failed[0]}")
            callgrind_control("--dump", pylon.pid)
            instructions = dumped_instructions(state, f"callgrind-{name}.out")
    return Count(path=name, requests=requests, instructions=instructions)


def run_rounds(
    commands: dict[str, Sequence[str]], *, rounds: int, requests: int, warmup: int
) -> list[Count]:
    names = list(commands)
    counts: list[Count] = []
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            count = count_once(name, commands[name], requests=requests, warmup=warmup)
            print(
                f"round {index + 1}/{rounds} {name}: {count.per_request / 1e6:.3f} M instructions"
                " per request",
                file=sys.stderr,
                flush=True,
            )
            counts.append(count)
    return counts


def report(counts: list[Count]) -> str:
    names = list(dict.fromkeys(count.path for count in counts))
    lines = ["Pylon's user-space instructions per small request (callgrind), one at a time:"]
    medians: dict[str, float] = {}
    for name in names:
        mine = [count.per_request for count in counts if count.path == name]
        medians[name] = statistics.median(mine)
        spread = (max(mine) - min(mine)) / medians[name]
        lines.append(
            f"  {name:10s} median {medians[name] / 1e6:7.3f} M"
            f"  (rounds {', '.join(f'{value / 1e6:.3f}' for value in mine)}; spread {spread:.1%})"
        )
    if len(names) == 2:
        first, second = names
        lines.append(f"  {second}/{first} {medians[second] / medians[first]:.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.instructions")
    parser.add_argument("--requests", type=int, default=200, help="measured, per round")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pylon-command", default=shlex.join(PYLON_COMMAND))
    parser.add_argument("--candidate-command", help="a second Pylon, measured in the same rounds")
    ns = parser.parse_args(argv)
    if valgrind_binary() is None:
        sys.exit("valgrind is not installed (Debian: apt-get install -y valgrind)")
    commands: dict[str, Sequence[str]] = {"pylon": shlex.split(ns.pylon_command)}
    if ns.candidate_command:
        commands["candidate"] = shlex.split(ns.candidate_command)
    os.environ.setdefault("PYTHONHASHSEED", "0")  # the same dict layouts in every round
    counts = run_rounds(commands, rounds=ns.rounds, requests=ns.requests, warmup=ns.warmup)
    print(report(counts))


if __name__ == "__main__":
    main()
