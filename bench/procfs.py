"""CPU time and memory (current and peak RSS) of a process, from /proc (Linux; no psutil).

Strategy: the parsers are pure functions over the files' text (table-tested);
the readers are small loops around them. utime + stime count every thread of
a process (Caddy's goroutines included), in clock ticks; a measured process
counts with every process below it (Pylon's workers under its supervisor).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
RESET_PEAK_RSS = b"5"
"""Writing 5 to /proc/<pid>/clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""


class CpuTimes(NamedTuple):
    """CPU time split as the kernel counts it: in the process's own code (user) and in
    system calls on its behalf (system). Python's cost shows in the first, a
    proxy's socket work in the second."""

    user: float
    system: float

    @property
    def total(self) -> float:
        return self.user + self.system

    def since(self, earlier: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user - earlier.user, self.system - earlier.system)


def parse_stat_user_system_ticks(stat: str) -> tuple[int, int]:
    """utime and stime (fields 14 and 15) of a /proc/<pid>/stat line.

    The command name (field 2) is in parentheses and may contain spaces, so
    fields are counted from the last ")".
    """
    after_name = stat[stat.rindex(")") + 2 :].split()
    return int(after_name[11]), int(after_name[12])


def parse_stat_ppid(stat: str) -> int:
    """The parent pid (field 4) of a /proc/<pid>/stat line."""
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (Pylon's workers under its supervisor)."""
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(stat_file.parent.name)
            children.setdefault(parse_stat_ppid(stat_file.read_text()), []).append(pid)
    tree, frontier = [root], [root]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        tree += frontier
    return tree


def parse_status_kib(status: str, field: str) -> int | None:
    """A "Name:  123 kB" field of /proc/<pid>/status, in KiB; None when absent."""
    for line in status.splitlines():
        name, sep, value = line.partition(":")
        if sep and name == field:
            return int(value.split()[0])
    return None


def parse_busy_ticks(proc_stat: str) -> int:
    """Busy ticks of all CPUs from /proc/stat's first line: everything but idle and iowait."""
    fields = proc_stat.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError("not /proc/stat")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return user + nice + system + irq + softirq + steal


def machine_busy_seconds() -> float:
    """CPU time the whole machine has spent busy: compared with the processes under
    test, it shows how much other work shared the cores during a run."""
    return parse_busy_ticks(Path("/proc/stat").read_text()) / CLOCK_TICKS_PER_S


def background_busy_cores(interval_s: float = 1.0) -> float:
    """How many cores other work keeps busy right now (sampled before a bench starts)."""
    before = machine_busy_seconds()
    time.sleep(interval_s)
    return (machine_busy_seconds() - before) / interval_s


def parse_udp_drops(proc_net_udp: str, port: int) -> int | None:
    """Datagrams dropped at the UDP sockets bound to `port` (last column of /proc/net/udp;
    several with SO_REUSEPORT workers), because a receive buffer was full; None when no
    socket has that port."""
    wanted = f":{port:04X}"
    drops = [
        int(fields[-1])
        for fields in map(str.split, proc_net_udp.splitlines()[1:])
        if len(fields) > 12 and fields[1].endswith(wanted)
    ]
    return sum(drops) if drops else None


def parse_rcvbuf_errors(proc_net_snmp: str) -> int:
    """Udp RcvbufErrors of the whole machine from /proc/net/snmp."""
    lines = [line.split() for line in proc_net_snmp.splitlines() if line.startswith("Udp:")]
    names, values = lines[0], lines[1]
    return int(values[names.index("RcvbufErrors")])


def udp_drops(port: int) -> int | None:
    return parse_udp_drops(Path("/proc/net/udp").read_text(), port)


def udp_rcvbuf_errors() -> int:
    """Every UDP datagram the machine dropped for a full socket buffer (QUIC loss on loopback)."""
    return parse_rcvbuf_errors(Path("/proc/net/snmp").read_text())


def cpu_times(pid: int) -> CpuTimes:
    """User and system CPU time of `pid` and every process below it."""
    user = system = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # exited since the walk
            member_user, member_system = parse_stat_user_system_ticks(
                Path(f"/proc/{member}/stat").read_text()
            )
            user, system = user + member_user, system + member_system
    return CpuTimes(user / CLOCK_TICKS_PER_S, system / CLOCK_TICKS_PER_S)


def cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and every process below it."""
    return cpu_times(pid).total


def _tree_kib_field(pid: int, field: str, *, file: str = "status") -> int | None:
    """A "Name:  123 kB" field of /proc/<pid>/<file> summed over `pid` and every process
    below it; None when no process of the tree reports it (the root has exited)."""
    values = []
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # exited since the walk
            values.append(parse_status_kib(Path(f"/proc/{member}/{file}").read_text(), field))
    known = [kib for kib in values if kib is not None]
    return sum(known) * 1024 if known else None


def peak_rss_bytes(pid: int) -> int | None:
    """Sum of the peak RSS of `pid` and every process below it: an upper bound on the
    tree's peak, since the processes need not peak at the same moment."""
    return _tree_kib_field(pid, "VmHWM")


def rss_bytes(pid: int) -> int | None:
    """Current RSS (VmRSS) of `pid` and every process below it. Pages the processes
    share (the interpreter and libraries of exec'd workers) count once per process."""
    return _tree_kib_field(pid, "VmRSS")


def pss_bytes(pid: int) -> int | None:
    """Proportional set size of `pid` and every process below it: each shared page
    counts as its share per process mapping it, so the sum is the tree's own memory
    (smaps_rollup, Linux >= 4.14; None where it is missing)."""
    return _tree_kib_field(pid, "Pss", file="smaps_rollup")


def reset_peak_rss(pid: int) -> bool:
    """Start a new VmHWM window for the tree; False when the kernel refuses one (the
    peak stays cumulative)."""
    refused = False
    for member in process_tree(pid):
        try:
            Path(f"/proc/{member}/clear_refs").write_bytes(RESET_PEAK_RSS)
        except OSError:
            refused = True
    return not refused


def parse_cpu_list(text: str) -> frozenset[int]:
    """A CPU list as Linux writes one ("1", "0,2", "2-3,6"); ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        low = int(first)
        high = int(last) if last else low
        if low < 0 or high < low:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def tree_threads(pid: int) -> Iterator[int]:
    """The thread ids of `pid` and of every process below it."""
    for member in process_tree(pid):
        for task in Path(f"/proc/{member}/task").glob("[0-9]*"):
            yield int(task.name)


def pin_tree(pid: int, cpus: frozenset[int]) -> int:
    """Run every thread of `pid` and of every process below it on `cpus` only; threads
    and processes they start later inherit it. Returns how many threads were pinned."""
    pinned = 0
    for thread in tree_threads(pid):
        with contextlib.suppress(OSError):  # exited since the walk
            os.sched_setaffinity(thread, cpus)
            pinned += 1
    return pinned


def thread_affinities(pid: int) -> list[frozenset[int]]:
    """The CPU set of every thread of `pid` and of every process below it."""
    found = []
    for thread in tree_threads(pid):
        with contextlib.suppress(OSError):  # exited since the walk
            found.append(frozenset(os.sched_getaffinity(thread)))
    return found
