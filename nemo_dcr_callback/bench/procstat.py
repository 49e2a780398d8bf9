"""CPU accounting from /proc (Linux), for the benchmarks: a process's CPU, a process tree's,
and the whole host's busy and idle time."""

from __future__ import annotations

import os
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu(f: list[str]) -> float:
    return (int(f[11]) + int(f[12])) / _HZ


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    return _cpu(_stat_fields(pid))


def tree(root: int) -> dict[int, tuple[float, str]]:
    """CPU seconds and command line (NUL-separated) of root and every process below it;
    processes that exit while being read are left out."""
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = _stat_fields(int(d))
                kids.setdefault(int(f[1]), []).append(int(d))
                cpu[int(d)] = _cpu(f)
            except (OSError, IndexError, ValueError):
                continue
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            out[pid] = (cpu[pid], Path(f"/proc/{pid}/cmdline").read_text())
        except (OSError, KeyError):
            continue
    return out


def _host() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def host_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores; idle and iowait excluded)."""
    f = _host()
    return (sum(f[:8]) - f[3] - f[4]) / _HZ


def host_idle_s() -> float:
    """CPU seconds the whole machine spent idle (all cores; iowait included)."""
    f = _host()
    return (f[3] + f[4]) / _HZ
