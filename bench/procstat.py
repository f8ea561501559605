"""CPU and memory of a process, read from /proc (Linux)."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


@dataclass
class CpuWindow:
    """CPU use of ``pid`` between :meth:`start` and :meth:`stop`, as a share of one core."""

    pid: int
    _cpu: float = 0.0
    _wall: float = 0.0

    def start(self) -> None:
        self._cpu, self._wall = cpu_seconds(self.pid), time.monotonic()

    def stop(self) -> float:
        return (cpu_seconds(self.pid) - self._cpu) / (time.monotonic() - self._wall)


def open_fds(pid: int) -> int:
    """File descriptors the process holds (sockets, files, pipes, epoll)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def raise_fd_limit(needed: int | None = None) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it): floods
    and fleets of thousands of connections need more than the usual 1,024. Returns the new
    limit; with ``needed``, OSError if even the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if needed is not None and target < needed:
        raise OSError(f"{needed} file descriptors needed, the hard limit is {hard} (ulimit -Hn)")
    if soft != target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target
