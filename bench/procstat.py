"""CPU seconds of processes, read from /proc: what the benchmarks charge to a server and its workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every live process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        yield int(stat.parent.name), fields


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in a process group (a server and its workers)."""
    return sum(int(f[11]) + int(f[12]) for _, f in _stats() if int(f[2]) == pgid) / CLK_TCK


def group_processes(pgid: int) -> int:
    """Live processes in a process group."""
    return sum(int(f[2]) == pgid for _, f in _stats())


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of a server and its children: PostgreSQL's postmaster and every process it forks
    (backends, checkpointer, WAL writer, autovacuum). A child that exits meanwhile (a backend whose connection
    closed) is not lost: once reaped, its time is in the postmaster's cutime and cstime."""
    total = 0
    for pid, f in _stats():
        if pid == root:
            total += sum(int(x) for x in f[11:15])  # utime, stime, cutime, cstime
        elif int(f[1]) == root:
            total += int(f[11]) + int(f[12])
    return total / CLK_TCK
